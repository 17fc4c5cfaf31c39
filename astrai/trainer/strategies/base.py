"""BaseStrategy and StrategyFactory: how a batch becomes a loss.

The trainer owns the loop (accumulation, optimizer, callbacks); a strategy owns only
the objective. Keeping that line sharp is what lets SEQ, SFT, DPO, GRPO and the KL
stage share one loop: each reads the batch keys of its dataset and returns a scalar.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from astrai.factory import BaseFactory
from astrai.model.components.linear_cross_entropy import IGNORE_INDEX


class BaseStrategy:
    """One training objective.

    ``model`` is the (possibly DDP-wrapped) model the optimizer updates; ``device``
    is where batches go. Subclasses implement ``compute_loss`` and may:

    - fill ``self.metrics`` (name → float, or a 0-d tensor left on its device: the
      trainer reads those to the host once per optimizer step) on each call; the metric
      logger records it;
    - override ``count_loss_units(batch)`` to return how many units (tokens, pairs)
      the returned *mean* loss averages over, so the trainer can weight micro-batches
      and ranks and make gradient accumulation exactly equal to one big batch;
    - override ``callbacks()`` to contribute TrainCallbacks (e.g. GRPO's weight re-sync);
    - override ``state_dict()``/``load_state_dict()`` for state of their own that a resumed
      run needs (a reference snapshot, step counters): it is saved with every checkpoint.
    """

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu", **kwargs: Any):
        self.model = model
        self.device = torch.device(device)
        self.metrics: dict[str, float | torch.Tensor] = {}
        self.options = kwargs

    @classmethod
    def module_to_train(cls, model: nn.Module, train_data: Any, config: Any) -> nn.Module:
        """The module the optimizer updates, checkpoints hold and the run saves: the loaded model,
        except for a strategy that trains something beside a frozen model (a draft head)."""
        return model

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.compute_loss(batch)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss(batch)")

    def count_loss_units(self, batch: dict[str, torch.Tensor]) -> Optional[int]:
        """Units the mean loss of ``batch`` averages over; None = weigh micro-batches equally."""
        return None

    def callbacks(self) -> list:
        return []

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values (loadable with ``weights_only=True``); empty when a rebuild is exact."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, after the strategy was built on a checkpoint's weights."""

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        non_blocking = self.device.type == "cuda"
        return {k: v.to(self.device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in batch.items()}

    @staticmethod
    def add_aux_loss(loss: torch.Tensor, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Add the MoE load-balancing loss when the model produced one."""
        aux = outputs.get("aux_loss")
        return loss if aux is None else loss + aux.to(loss.dtype)


class StrategyFactory(BaseFactory[BaseStrategy]):
    """train_type → strategy class ('seq', 'sft', and the alignment strategies)."""

    kind = "train_type"

    @classmethod
    def create(cls, model: nn.Module, train_type: str, device: str | torch.device = "cpu", **kwargs: Any) -> BaseStrategy:
        return cls._registry.get(train_type)(model, device, **kwargs)
