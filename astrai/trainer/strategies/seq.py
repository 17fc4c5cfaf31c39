"""SEQ (pre-training) and SFT strategies: next-token cross-entropy."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from astrai.errors import DataError
from astrai.parallel.wrap import unwrap_model
from astrai.trainer.strategies.base import IGNORE_INDEX, BaseStrategy, StrategyFactory
from astrai.trainer.strategies.masks import model_inputs


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Mean cross-entropy over targets that are not IGNORE_INDEX, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           label_smoothing=label_smoothing)


@StrategyFactory.register("seq")
class SEQStrategy(BaseStrategy):
    """Pre-training: predict every next token (``input_ids`` → ``target_ids``)."""

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu", label_smoothing: float = 0.0, **kwargs: Any):
        super().__init__(model, device, **kwargs)
        self.label_smoothing = float(label_smoothing)
        # astrai's Transformer fuses the vocabulary projection with the loss; any other model gives logits
        self._model_computes_loss = "target_ids" in inspect.signature(unwrap_model(model).forward).parameters

    def targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["target_ids"]

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = self.to_device(batch)
        targets = self.targets(batch)
        if self._model_computes_loss:
            outputs = self.model(**model_inputs(batch), target_ids=targets, label_smoothing=self.label_smoothing)
            loss = outputs["loss"]
        else:
            outputs = self.model(**model_inputs(batch))
            loss = token_cross_entropy(outputs["logits"], targets, self.label_smoothing)
        return self.add_aux_loss(loss, outputs)

    def count_loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((self.targets(batch) != IGNORE_INDEX).sum())


@StrategyFactory.register("sft")
class SFTStrategy(SEQStrategy):
    """Supervised fine-tuning: the loss counts only tokens where ``loss_mask`` is 1
    (the assistant's replies); packed conversations get a document mask from ``doc_ids``."""

    def targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "loss_mask" not in batch:
            raise DataError("SFT batch has no 'loss_mask'; load the data with train_type 'sft'")
        mask = batch["loss_mask"].to(device=batch["target_ids"].device, dtype=torch.bool)
        return batch["target_ids"].masked_fill(~mask, IGNORE_INDEX)
