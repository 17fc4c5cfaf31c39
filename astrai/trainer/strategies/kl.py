"""KL-staged training (spec 003): language-model stages, each later one anchored to a frozen snapshot.

Stage 0 is plain next-token training. At each stage boundary the run evaluates,
saves a checkpoint ``boundary_<i>_<j>`` (from stage i to stage j), and freezes a
copy of the weights as the reference; from then on the loss is NLL + β·KL(policy ‖
reference), which keeps the new stage from drifting far from what the earlier stages
learnt. The KL is exact by default (per token, over the vocabulary: both models' logits
are at hand). The spec's estimate, policy NLL − stop-grad reference NLL, is offered as
``estimate="nll_difference"``: its gradient is the NLL's own, so it does not anchor.
Each stage has its own token budget and dataset mixture.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from astrai.errors import CheckpointError, ConfigError, DataError
from astrai.trainer.strategies.base import IGNORE_INDEX, StrategyFactory
from astrai.trainer.strategies.losses import kl_stage_loss, token_kl
from astrai.trainer.strategies.masks import model_inputs
from astrai.trainer.strategies.reference import ReferenceModel, unwrap
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
        self.beta, self.reference, self.stage, self.estimate = float(beta), reference, int(stage), estimate

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


def train_kl_stages(config, stages: Sequence[Any], beta: float = 0.1, model: Optional[nn.Module] = None,
                    tokenizer: Any = None, callbacks: Optional[list] = None, val_dataset=None,
                    resume: Optional[str] = None, estimate: str = "exact") -> nn.Module:
    """Run every stage with the trainer, handing the weights (and the reference) from one to the next.

    Stage i writes its checkpoints under ``<ckpt_dir>/stage_<i>``; the boundary checkpoints,
    ``boundaries.jsonl`` (stage, tokens, validation loss) and the run's ``train_config.json`` go
    to ``<ckpt_dir>`` itself. ``resume`` ("latest", the run directory or a checkpoint in it)
    continues where the run stopped: finished stages are skipped, the reference is rebuilt
    from the boundary checkpoint, and the current stage resumes from its latest save.
    Returns the model.
    """
    from astrai.parallel.wrap import load_full_model_state
    from astrai.serialization import Checkpoint, latest_checkpoint
    from astrai.trainer.builder import load_model
    from astrai.trainer.trainer import Trainer

    plan = Stage.parse(stages)
    root = Path(config.ckpt_dir)
    stage_configs = [stage_config_for(config, plan, i, beta, estimate) for i in range(len(plan))]
    check_stage_data(stage_configs, plan)
    start, checkpoint = resume_point(root, len(plan), resume) if resume else (0, None)
    root.mkdir(parents=True, exist_ok=True)
    config.save(root / RUN_CONFIG_NAME)
    model = model if model is not None else load_model(config)
    reference: Optional[ReferenceModel] = None
    if start > 0:  # the snapshot is exactly the boundary checkpoint's weights
        load_full_model_state(model, Checkpoint.load(root / boundary_name(start - 1)).state_dict)
        reference = snapshot_reference(model)
    for i in range(start, len(plan)):
        stage, stage_config = plan[i], stage_configs[i]
        trainer = Trainer(stage_config, callbacks=callbacks, model=model, tokenizer=tokenizer,
                          train_dataset=stage.dataset_object, val_dataset=val_dataset,
                          strategy_extra={"reference": reference, "stage": i})
        context = trainer.train(checkpoint if i == start else None)
        if context is None:  # the stage ran in spawned processes: its final save holds the weights
            final = Checkpoint.load(latest_checkpoint(stage_config.ckpt_dir))
            model.load_state_dict(final.state_dict)
            progress = {"tokens_seen": final.meta["tokens_seen"], "epoch": final.epoch, "iteration": final.iteration}
            val_loss = None
        else:
            model = unwrap(context.model)
            progress = {"tokens_seen": context.tokens_seen, "epoch": context.epoch, "iteration": context.iteration}
            val_loss = boundary_val_loss(context, config.validation_batches)
        if i == len(plan) - 1:
            break
        name = boundary_name(i)
        meta = {"stage": i, "next_stage": i + 1, "tokens_seen": progress["tokens_seen"], "val_loss": val_loss,
                "beta": beta, "train_config": stage_config.to_dict()}
        Checkpoint({k: v.detach().clone() for k, v in model.state_dict().items()}, epoch=progress["epoch"],
                   iteration=progress["iteration"], meta=meta).save(root / name)
        reference = snapshot_reference(model)
        with open(root / "boundaries.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"boundary": name, **{k: v for k, v in meta.items() if k != "train_config"}}) + "\n")
    return model


RUN_CONFIG_NAME = "train_config.json"


def boundary_name(stage: int) -> str:
    return f"boundary_{stage}_{stage + 1}"


def boundary_val_loss(context, max_batches: int) -> Optional[float]:
    from astrai.trainer.callbacks.validation import evaluate

    return evaluate(context, max_batches) if context.val_loader is not None else None


def resume_point(root: Path, n_stages: int, resume: str) -> tuple[int, Optional[Path]]:
    """Where a KL run continues: (the stage, the checkpoint to resume it from, or None to start
    it at its boundary). ``resume`` is "latest", the run directory, a stage's checkpoint or a boundary."""
    from astrai.serialization import latest_checkpoint

    target = root if resume == "latest" else Path(resume)
    if target.resolve() != root.resolve():
        stage_dir = re.fullmatch(r"stage_(\d+)", target.parent.name)
        boundary = re.fullmatch(r"boundary_(\d+)_(\d+)", target.name)
        if stage_dir and int(stage_dir.group(1)) < n_stages:
            return int(stage_dir.group(1)), target
        if boundary and int(boundary.group(2)) < n_stages:
            return int(boundary.group(2)), None
        raise CheckpointError(f"--resume {resume}: not a KL run's stage checkpoint (stage_<i>/step_*) or boundary "
                              f"(boundary_<i>_<j>) for {n_stages} stages")
    stage = next(s for s in range(n_stages) if s == n_stages - 1 or not (root / boundary_name(s) / "meta.json").is_file())
    found = latest_checkpoint(root / f"stage_{stage}")
    if found is None and stage == 0:
        raise CheckpointError(f"--resume: no checkpoint of a KL run under {root}")
    return stage, found


def stage_config_for(config, plan: Sequence[Stage], i: int, beta: float, estimate: str = "exact"):
    """Stage i's TrainConfig: its own budget, directories and (when given as paths) data mixture."""
    from astrai.config import TrainConfig

    fields = {**config.to_dict(), "train_type": "kl", "total_tokens": plan[i].tokens, "max_steps": None,
              "ckpt_dir": str(Path(config.ckpt_dir) / f"stage_{i}"),
              "log_dir": str(Path(config.log_dir or config.ckpt_dir) / f"stage_{i}"),
              "save_final_model": i == len(plan) - 1 and config.save_final_model,
              "strategy_kwargs": {**config.strategy_kwargs, "beta": beta, "estimate": estimate}}
    if isinstance(plan[i].datasets, list):
        fields.update(datasets=plan[i].datasets, data_root_path=None)
    return TrainConfig.from_dict(fields, source=f"KL stage {i}")


def check_stage_data(stage_configs: Sequence[Any], plan: Sequence[Stage]) -> None:
    """Open every stage's data before stage 0 trains, so a bad path in a late stage costs seconds, not
    the earlier stages' training. Errors name the stage."""
    from astrai.trainer.data import resolve_data

    for i, (stage_config, stage) in enumerate(zip(stage_configs, plan)):
        if stage.dataset_object is not None:
            continue  # nothing to open
        try:
            stage_config.validate(require_model=False)
            resolve_data(stage_config)  # what the stage's Trainer will open, mixture rules included
        except (ConfigError, DataError) as error:
            raise type(error)(f"KL stage {i}: {error}") from error
