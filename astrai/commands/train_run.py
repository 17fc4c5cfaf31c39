"""What ``astrai train`` runs once its flags (astrai/commands/train.py) have parsed: every
TrainConfig field is a flag, ``--config`` supplies a JSON base.

Precedence: flags > ``--config`` file > the resumed checkpoint's config > defaults.

This module sits above both the generic loop (astrai/trainer) and alignment
(astrai/alignment), so it is the one place that chooses between them: a config that needs a
reward head, LoRA adapters or KL stages goes to ``astrai.alignment.train``, every other one
straight to a Trainer. Importing astrai.alignment here registers its train types.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from astrai.alignment import needs_alignment_run, train
from astrai.alignment.kl_stages import kl_run_config
from astrai.commands.train import STRATEGY_FLAGS
from astrai.config import TrainConfig
from astrai.errors import CheckpointError, ConfigError
from astrai.model.draft_head import is_draft_head
from astrai.parallel import cleanup_parallel
from astrai.serialization import Checkpoint, latest_checkpoint
from astrai.trainer import Trainer
from astrai.trainer.builder import TrainContextBuilder, check_model_fits, load_model, load_tokenizer, total_steps_for
from astrai.trainer.data import resolve_data


def build_config(args: argparse.Namespace) -> tuple[TrainConfig, str | None]:
    """The merged config and the checkpoint directory to resume from (or None)."""
    names = {f.name for f in fields(TrainConfig)}
    flags = {k: v for k, v in vars(args).items() if k in names}
    base = TrainConfig.load(args.config).to_dict() if args.config else {}
    config = TrainConfig.from_dict({**base, **flags}, source=args.config or "flags")
    resume = None
    if args.resume and config.train_type == "kl":
        resume = args.resume  # a staged run finds its place itself (astrai/alignment/kl_stages.py)
    elif args.resume:
        if args.resume == "latest":
            found = latest_checkpoint(config.ckpt_dir)
            if found is None:
                raise CheckpointError(f"--resume: no checkpoint under ckpt_dir {config.ckpt_dir!r}")
            resume = str(found)
        else:
            resume = args.resume
        if not args.config:
            saved = Checkpoint.read_meta(resume)["meta"].get("train_config", {})
            config = TrainConfig.from_dict({**saved, **flags}, source=f"{resume}/meta.json")
            run_config = kl_run_config(resume, saved)
            if run_config is not None:  # a KL stage's checkpoint: the run's own config drives the stages
                config = TrainConfig.from_dict({**TrainConfig.load(run_config).to_dict(), **flags}, source=str(run_config))
    config.strategy_kwargs.update(alignment_strategy_kwargs(args))
    return config, resume


def alignment_strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy_kwargs entries given by flags (only the flags actually passed), so they are
    saved in every checkpoint's meta.json and a resumed run gets them back; LoRA's go under ``lora``."""
    given = vars(args)
    kwargs = {name: given[name] for name in STRATEGY_FLAGS if name in given}
    if "stage_tokens" in given or "stage_datasets" in given:
        tokens = given.get("stage_tokens")
        mixtures = given.get("stage_datasets")
        if tokens is None:
            raise ConfigError("--stage_datasets needs --stage_tokens (one budget per stage)")
        if mixtures is not None and len(mixtures) != len(tokens):
            raise ConfigError(f"--stage_datasets has {len(mixtures)} mixtures for {len(tokens)} stages")
        kwargs["stages"] = [{"tokens": t, **({"datasets": mixtures[i]} if mixtures else {})} for i, t in enumerate(tokens)]
    if "lora_rank" in given:
        rank = given["lora_rank"]
        kwargs["lora"] = {"rank": rank, "alpha": given.get("lora_alpha", 2.0 * rank)}
        if "lora_targets" in given:
            kwargs["lora"]["targets"] = given["lora_targets"]
    elif "lora_alpha" in given or "lora_targets" in given:
        raise ConfigError("--lora_alpha/--lora_targets need --lora_rank")
    return kwargs


def estimate_memory_bytes(model_config, config: TrainConfig, n_params: int) -> dict[str, int]:
    """Rough peak per device: fp32 weights+grads+AdamW moments, plus activations of one micro-batch."""
    tokens = config.batch_per_device * config.window_size
    per_layer = tokens * model_config.dim * 34 + 5 * model_config.n_heads * config.batch_per_device * config.window_size ** 2
    act_bytes = 2 if config.precision == "bf16" else 4
    layers = 1 if config.gradient_checkpointing else model_config.n_layers
    activations = per_layer * layers * act_bytes // 2 + tokens * model_config.vocab_size * 4 * 2
    states = n_params * 16
    return {"weights_grads_optimizer": states, "activations": activations, "total": states + activations}


def dry_run(config: TrainConfig) -> int:
    TrainContextBuilder(config).validate()
    model = load_model(config)
    check_model_fits(config, model, load_tokenizer(config))
    data = resolve_data(config)
    world = config.nprocs
    train_len = sum(len(s) for s in data.train_sources)
    steps_per_epoch = train_len // world // config.batch_per_device // config.grad_accum_steps
    tokens_per_step = config.batch_per_device * config.window_size * config.grad_accum_steps * world
    total = total_steps_for(config, max(steps_per_epoch, 1), tokens_per_step)
    n_params = model.num_parameters()
    memory = estimate_memory_bytes(model.config, config, n_params)
    gib = 1024 ** 3
    print(f"train_type        {config.train_type}")
    print(f"parameters        {n_params:,}")
    print(f"training samples  {train_len:,} (validation: {len(data.val) if data.val is not None else 0:,})")
    print(f"tokens per step   {tokens_per_step:,} = {config.batch_per_device} batch x {config.window_size} window "
          f"x {config.grad_accum_steps} accum x {world} procs")
    print(f"steps per epoch   {steps_per_epoch:,}")
    print(f"total steps       {total:,} ({total * tokens_per_step:,} tokens)")
    print(f"memory estimate   {memory['total'] / gib:.2f} GiB per device "
          f"({memory['weights_grads_optimizer'] / gib:.2f} weights/grads/AdamW + {memory['activations'] / gib:.2f} activations)")
    return 0


def run(args: argparse.Namespace) -> int:
    config, resume = build_config(args)
    if args.dry_run:
        return dry_run(config)
    Path(config.ckpt_dir).mkdir(parents=True, exist_ok=True)
    context = train(config, resume) if needs_alignment_run(config) else Trainer(config).train(resume)
    cleanup_parallel()  # under torchrun the Trainer joined the group: leave it before the interpreter exits
    if context is not None and context.stop_requested:
        print(f"astrai train: interrupted at step {context.step}; resume with --resume --ckpt_dir {config.ckpt_dir}")
        return 130
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank runs this; one line is enough
        print(written_line(config))
    return 0


def written_line(config: TrainConfig) -> str:
    """The run's last line: where the trained model went, the directory ``generate``/``serve --model`` take next."""
    root = Path(config.ckpt_dir)
    if config.train_type == "draft_head" and is_draft_head(root / "final"):
        return f"wrote {root / 'final'}: the trained draft head (checkpoints under {root})"
    finals = sorted(root.glob("**/final/config.json"), key=lambda p: p.stat().st_mtime)
    if not finals:
        return f"astrai train: checkpoints under {root} (no model directory: save_final_model is off)"
    adapter = root / "adapter"
    lora = f", LoRA adapters in {adapter}" if (adapter / "adapter_config.json").is_file() else ""
    return f"wrote {finals[-1].parent}: the trained model{lora} (checkpoints under {root})"


__all__ = ["alignment_strategy_kwargs", "build_config", "dry_run", "run", "written_line"]
