"""A KL-staged run (spec 003): one Trainer per stage, the weights and a frozen reference handed
from each stage to the next, a checkpoint and validation loss at every boundary.

The loss each stage trains with is KLStrategy's (astrai/alignment/kl.py); this module is
the run around it. It sits above the trainer because it builds and runs Trainers, which a
strategy (a part the trainer runs) cannot do without importing its own caller.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

from astrai.alignment.kl import Stage, snapshot_reference
from astrai.alignment.reference import ReferenceModel, unwrap
from astrai.config import TrainConfig
from astrai.errors import CheckpointError, ConfigError, DataError
from astrai.parallel.wrap import load_full_model_state
from astrai.serialization import Checkpoint, latest_checkpoint
from astrai.trainer.builder import load_model
from astrai.trainer.callbacks.validation import evaluate
from astrai.trainer.data import resolve_data
from astrai.trainer.trainer import Trainer


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


def kl_run_config(checkpoint: str, saved: dict) -> Optional[Path]:
    """The whole run's train_config.json when ``checkpoint`` is a KL run's stage save or boundary."""
    if saved.get("train_type") != "kl":
        return None
    path = Path(checkpoint)
    for root in (path.parent, path.parent.parent):
        if (root / RUN_CONFIG_NAME).is_file():
            return root / RUN_CONFIG_NAME
    return None


def boundary_name(stage: int) -> str:
    return f"boundary_{stage}_{stage + 1}"


def boundary_val_loss(context, max_batches: int) -> Optional[float]:
    return evaluate(context, max_batches) if context.val_loader is not None else None


def resume_point(root: Path, n_stages: int, resume: str) -> tuple[int, Optional[Path]]:
    """Where a KL run continues: (the stage, the checkpoint to resume it from, or None to start
    it at its boundary). ``resume`` is "latest", the run directory, a stage's checkpoint or a boundary."""
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
    for i, (stage_config, stage) in enumerate(zip(stage_configs, plan)):
        if stage.dataset_object is not None:
            continue  # nothing to open
        try:
            stage_config.validate(require_model=False)
            resolve_data(stage_config)  # what the stage's Trainer will open, mixture rules included
        except (ConfigError, DataError) as error:
            raise type(error)(f"KL stage {i}: {error}") from error
