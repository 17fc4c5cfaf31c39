"""The frozen reference model that DPO, GRPO and the KL stage compare the policy against.

Three sources, cheapest first: with LoRA the base model itself (adapters switched
off, no second copy); a checkpoint directory given as ``ref_path``; otherwise a
frozen snapshot of the policy's weights at the moment the strategy is built.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

from astrai.model import AutoModel
from astrai.model.lora import adapters_disabled, has_lora


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under a DDP/FSDP-style wrapper (which keep it in ``.module``)."""
    return getattr(model, "module", model)


def frozen(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class ReferenceModel:
    """Runs the reference under ``torch.no_grad`` and can be re-synced to the policy."""

    def __init__(self, policy: nn.Module, ref_model: Optional[nn.Module] = None, ref_path: Optional[str] = None,
                 use_lora_base: bool = True):
        self.policy = unwrap(policy)
        param = next(self.policy.parameters())
        if ref_model is not None:
            self.model: Optional[nn.Module] = frozen(ref_model)
        elif ref_path:
            self.model = frozen(AutoModel.from_pretrained(ref_path, dtype=param.dtype, device=param.device))
        elif use_lora_base and has_lora(self.policy):
            self.model = None
        else:
            self.model = frozen(copy.deepcopy(self.policy))

    @property
    def is_lora_base(self) -> bool:
        return self.model is None

    @contextmanager
    def active(self) -> Iterator[nn.Module]:
        """The module to call for reference outputs (gradients off)."""
        with torch.no_grad():
            if self.model is None:
                with adapters_disabled(self.policy):
                    yield self.policy
            else:
                yield self.model

    def sync(self) -> bool:
        """Copy the policy's current weights into the reference; False for the LoRA base (fixed by design)."""
        if self.model is None:
            return False
        with torch.no_grad():
            source = self.policy.state_dict()
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(source[name])
        return True
