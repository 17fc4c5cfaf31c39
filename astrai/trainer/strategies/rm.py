"""RMStrategy: train a reward model on preference pairs with L_RM = −log σ(r(x, y_w) − r(x, y_l))."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from astrai.errors import ConfigError
from astrai.model.reward import RewardModel, last_token_index
from astrai.trainer.strategies.base import BaseStrategy, StrategyFactory
from astrai.trainer.strategies.losses import REDUCTIONS, pairwise_reward_loss
from astrai.trainer.strategies.preference import check_preference_batch, stack_pairs
from astrai.trainer.strategies.reference import unwrap


def pair_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of the chosen and the rejected answers, read at each answer's last response token."""
    ids, mask = stack_pairs(batch)
    rewards = model(ids, logits_index=last_token_index(mask, ids))["rewards"]
    n = batch["chosen"].shape[0]
    return rewards[:n], rewards[n:]


@StrategyFactory.register("rm")
class RMStrategy(BaseStrategy):
    """Pairwise (Bradley–Terry) reward-model training; the model must be a RewardModel
    (``RewardModel.from_base(lm)`` turns a language model into one)."""

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu", reduction: str = "mean", **kwargs: Any):
        super().__init__(model, device, **kwargs)
        if not isinstance(unwrap(model), RewardModel):
            raise ConfigError(f"train_type 'rm' needs a RewardModel, got {type(unwrap(model)).__name__}; "
                              "convert a language model with RewardModel.from_base(model)")
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
        self.reduction = reduction

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        check_preference_batch(batch, "rm")
        batch = self.to_device(batch)
        chosen, rejected = pair_scores(self.model, batch)
        loss, metrics = pairwise_reward_loss(chosen, rejected, self.reduction)
        self.metrics = {"rm_loss": loss.detach(), **metrics}
        return loss

    def count_loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["chosen"].shape[0])
