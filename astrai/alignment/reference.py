"""The frozen reference model that DPO, GRPO and the KL stage compare the policy against.

Three sources, cheapest first: with LoRA the base model itself (adapters switched
off, no second copy); a checkpoint directory given as ``ref_path``; otherwise a
frozen snapshot of the policy's weights at the moment the strategy is built.
A resumed run builds its strategy from the checkpoint's weights, so a snapshot (or a
reference re-synced to the policy) travels in the checkpoint (``state_dict``).
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


def cpu_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A module's weights as CPU tensors (gathered whole when sharded), for a training checkpoint."""
    state = {}
    for name, tensor in model.state_dict().items():
        full = getattr(tensor, "full_tensor", None)
        state[name] = (full() if callable(full) else tensor).detach().cpu()
    return state


def load_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(state[name])


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
        self.is_snapshot = ref_model is None and not ref_path and not (use_lora_base and has_lora(self.policy))
        self.synced = False
        if ref_model is not None:
            self.model: Optional[nn.Module] = frozen(ref_model)
        elif ref_path:
            self.model = frozen(AutoModel.from_pretrained(ref_path, dtype=param.dtype, device=param.device))
        elif use_lora_base and has_lora(self.policy):
            self.model = None
        else:
            self.model = frozen(copy.deepcopy(self.policy))

    def to(self, device: torch.device) -> "ReferenceModel":
        """Hold a separate reference on ``device``, where the policy trains (a snapshot taken
        before the trainer moved the policy there, as a resumed KL stage's is, stays behind)."""
        if self.model is not None:
            self.model.to(device)
        return self

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
        load_weights(self.model, self.policy.state_dict())
        self.synced = True
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a resumed run cannot rebuild: a snapshot's, or any reference's once re-synced.
        A given model, a ``ref_path`` and the LoRA base are rebuilt exactly from their source."""
        if self.model is None or not (self.is_snapshot or self.synced):
            return {}
        return cpu_weights(self.model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            load_weights(self.model, state)
            self.synced = not self.is_snapshot
