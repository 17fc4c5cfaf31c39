"""DPOStrategy: Direct Preference Optimization against a frozen reference model."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from astrai.alignment.group_packing import model_max_len, packed_logprobs_and_aux, packed_rows
from astrai.alignment.losses import REDUCTIONS, dpo_loss, reduce, response_sums, shifted_logprobs_and_aux
from astrai.alignment.preference import check_preference_batch, stack_attention, stack_pairs
from astrai.alignment.reference import ReferenceModel
from astrai.errors import ConfigError
from astrai.trainer.strategies.base import BaseStrategy, StrategyFactory


@StrategyFactory.register("dpo")
class DPOStrategy(BaseStrategy):
    """L = −log σ(β·[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))]).

    Sequence log-probs are sums over response tokens (``chosen_mask`` /
    ``rejected_mask``), with padding masked out where the batch has attention masks; an MoE
    policy's balancing loss is added. The reference is ``ref_model`` if given, else the checkpoint at
    ``ref_path``, else (with LoRA) the base with adapters off, else a frozen snapshot
    of the starting weights.

    ``rpo_alpha`` > 0 adds α times the chosen answers' negative log-likelihood per token
    (RPO, Pang et al. 2024, TRL's ``rpo_alpha``): DPO alone only widens the gap between the
    two answers, and where they differ in a token or two (a right and a slipped working) it
    lowers both, wearing away the answers SFT taught; the NLL term holds the chosen ones up.
    """

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu", beta: float = 0.1,
                 reduction: str = "mean", ref_model: Optional[nn.Module] = None, ref_path: Optional[str] = None,
                 rpo_alpha: float = 0.0, share_prompts: bool = True, **kwargs: Any):
        super().__init__(model, device, **kwargs)
        if not beta > 0:
            raise ConfigError(f"beta must be > 0 for DPO, got {beta!r}")
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
        if not rpo_alpha >= 0:
            raise ConfigError(f"rpo_alpha must be >= 0 (the weight of the chosen answers' NLL), got {rpo_alpha!r}")
        self.beta, self.reduction, self.rpo_alpha = float(beta), reduction, float(rpo_alpha)
        self.share_prompts = bool(share_prompts)
        self.reference = ReferenceModel(model, ref_model, ref_path)

    @property
    def ref_model(self) -> Optional[nn.Module]:
        return self.reference.model

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        check_preference_batch(batch, "dpo")
        batch = self.to_device(batch)
        ids, mask = stack_pairs(batch)
        attention = stack_attention(batch)
        n = batch["chosen"].shape[0]
        score = self.response_scorer(ids, mask, attention)
        policy, aux = score(self.model)
        with self.reference.active() as ref:
            reference = score(ref)[0]
        loss, metrics = dpo_loss(policy[:n], policy[n:], reference[:n], reference[n:], self.beta, self.reduction)
        self.metrics = {"dpo_loss": loss.detach(), **metrics}
        if self.rpo_alpha:
            chosen_tokens = mask[:n, 1:].sum(dim=1).clamp(min=1)
            nll = reduce(-policy[:n] / chosen_tokens, self.reduction)
            loss = loss + self.rpo_alpha * nll
            self.metrics["chosen_nll"] = nll.detach()
        return self.add_aux_loss(loss, {"aux_loss": aux})

    def response_scorer(self, ids: torch.Tensor, mask: torch.Tensor, attention: Optional[torch.Tensor]):
        """``score(model)`` → (each row's summed response log-prob [2n], the MoE balancing loss). A
        pair's chosen and rejected answers take their shared prompt once (``group_packing``) when
        ``share_prompts`` is on and the packed row fits the model; otherwise each row runs whole."""
        packed = packed_rows(ids, mask, model_max_len(self.model), attention) if self.share_prompts else None
        if packed is not None:
            packed = packed.to(ids.device)

            def score(model):
                logp, aux = packed_logprobs_and_aux(model, packed)
                return logp.sum(dim=1), aux
            return score

        def score(model):
            per_token, aux = shifted_logprobs_and_aux(model, ids, attention)
            return response_sums(per_token, mask), aux
        return score

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference.load_state_dict(state.get("reference", {}))

    def count_loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["chosen"].shape[0])
