"""KL-staged training (spec 003): language-model stages, each later one anchored to a frozen snapshot.

Stage 0 is plain next-token training. At each stage boundary the run evaluates,
saves a checkpoint ``boundary_<i>_<j>`` (from stage i to stage j), and freezes a
copy of the weights as the reference; from then on the loss is NLL + β·KL(policy ‖
reference), which keeps the new stage from drifting far from what the earlier stages
learnt. The KL is exact by default (per token, over the vocabulary: both models' logits
are at hand). The spec's estimate, policy NLL − stop-grad reference NLL, is offered as
``estimate="nll_difference"``: its gradient is the NLL's own, so it does not anchor.
Each stage has its own token budget and dataset mixture. This module holds the loss and the
stage plan; the run that drives one Trainer per stage is astrai/alignment/kl_stages.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from astrai.alignment.losses import kl_stage_loss, token_kl
from astrai.alignment.reference import ReferenceModel, unwrap
from astrai.errors import ConfigError
from astrai.trainer.strategies.base import IGNORE_INDEX, StrategyFactory
from astrai.trainer.strategies.masks import model_inputs
from astrai.trainer.strategies.seq import SEQStrategy, token_cross_entropy


KL_ESTIMATES = ("exact", "nll_difference")


@StrategyFactory.register("kl")
class KLStrategy(SEQStrategy):
    """Next-token loss plus β·KL(policy ‖ reference) once a reference exists.

    ``beta`` is the configured coefficient; the effective one (``effective_beta``) is 0
    until ``start_stage`` snapshots a reference (or one is passed in). ``estimate`` is
    "exact" (the per-token KL over the vocabulary) or "nll_difference" (spec 003's
    policy NLL − stop-grad reference NLL).
    """

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu", beta: float = 0.1,
                 reference: Optional[ReferenceModel] = None, stage: int = 0, label_smoothing: float = 0.0,
                 estimate: str = "exact", **kwargs: Any):
        super().__init__(model, device, label_smoothing=label_smoothing, **kwargs)
        if beta < 0:
            raise ConfigError(f"beta must be >= 0 for the KL stage, got {beta!r}")
        if estimate not in KL_ESTIMATES:
            raise ConfigError(f"estimate must be one of {', '.join(KL_ESTIMATES)} for the KL stage, got {estimate!r}")
        self.beta, self.stage, self.estimate = float(beta), int(stage), estimate
        self.reference = None if reference is None else reference.to(self.device)

    @property
    def effective_beta(self) -> float:
        return self.beta if self.reference is not None else 0.0

    @property
    def ref_model(self) -> Optional[nn.Module]:
        return None if self.reference is None else self.reference.model

    def start_stage(self, stage: int) -> ReferenceModel:
        """Freeze the current weights as the reference for stage ``stage`` onwards."""
        self.reference = snapshot_reference(self.model)
        self.stage = int(stage)
        return self.reference

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = self.to_device(batch)
        inputs = model_inputs(batch)
        targets = self.targets(batch)
        outputs = self.model(**inputs)
        nll = token_cross_entropy(outputs["logits"], targets, self.label_smoothing)
        if self.reference is None:
            loss, penalty = nll, torch.zeros(())
        else:
            with self.reference.active() as ref:
                ref_logits = ref(**inputs)["logits"]
            if self.estimate == "exact":
                penalty = token_kl(outputs["logits"], ref_logits, targets, IGNORE_INDEX)
                loss = nll + self.beta * penalty
            else:
                ref_nll = token_cross_entropy(ref_logits, targets, self.label_smoothing)
                loss, penalty = kl_stage_loss(nll, ref_nll, self.beta)
        self.metrics = {"stage": float(self.stage), "beta": self.effective_beta, "nll": nll.detach(),
                        "kl_penalty": penalty.detach()}
        return self.add_aux_loss(loss, outputs)


def snapshot_reference(model: nn.Module) -> ReferenceModel:
    """A frozen copy of the current weights (a real copy even under LoRA: the adapters are part of it)."""
    return ReferenceModel(unwrap(model), use_lora_base=False)


@dataclass
class Stage:
    """One stage: a token budget and (optionally) its own data: a mixture [{"path", "rate"}, ...]
    as in TrainConfig.datasets, or a Dataset object (for programmatic use)."""

    tokens: int
    datasets: Optional[list] = None

    @property
    def dataset_object(self) -> Any:
        """The Dataset given in place of a mixture of paths, or None."""
        return None if self.datasets is None or isinstance(self.datasets, list) else self.datasets

    @classmethod
    def parse(cls, stages: Sequence[Any]) -> list["Stage"]:
        parsed = []
        for i, raw in enumerate(stages):
            if isinstance(raw, Stage):
                raw = {"tokens": raw.tokens, "datasets": raw.datasets}
            entry = raw if isinstance(raw, dict) else {"tokens": raw}
            tokens = entry.get("tokens")
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
                raise ConfigError(f"KL stage {i}: 'tokens' must be a positive integer token budget, got {tokens!r}")
            parsed.append(cls(tokens, entry.get("datasets")))
        if len(parsed) < 2:
            raise ConfigError(f"KL-staged training needs at least 2 stages (a boundary to anchor to), got {len(parsed)}")
        return parsed
