"""RMStrategy: train a reward model on preference pairs with L_RM = −log σ(r(x, y_w) − r(x, y_l))."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from astrai.alignment.losses import REDUCTIONS, padded_inputs, pairwise_reward_loss
from astrai.alignment.preference import check_preference_batch, stack_attention, stack_pairs
from astrai.alignment.reference import unwrap
from astrai.errors import ConfigError
from astrai.model.reward import RewardModel, last_token_index
from astrai.trainer.strategies.base import BaseStrategy, StrategyFactory


def pair_outputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reward model's outputs on chosen rows then rejected rows, read at each answer's last
    response token (padding masked out where the batch has attention masks)."""
    ids, mask = stack_pairs(batch)
    return model(ids, logits_index=last_token_index(mask, ids), **padded_inputs(stack_attention(batch)))


def pair_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of the chosen and the rejected answers."""
    rewards = pair_outputs(model, batch)["rewards"]
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
        outputs = pair_outputs(self.model, batch)
        n = batch["chosen"].shape[0]
        loss, metrics = pairwise_reward_loss(outputs["rewards"][:n], outputs["rewards"][n:], self.reduction)
        self.metrics = {"rm_loss": loss.detach(), **metrics}
        return self.add_aux_loss(loss, outputs)

    def count_loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["chosen"].shape[0])
