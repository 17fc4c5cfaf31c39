"""Turning a TrainContext into a Checkpoint and back (weights, optimizer, schedule, data order, RNG,
and the strategy's own state: a reference snapshot, GRPO's schedule)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from astrai.parallel.wrap import full_model_state, full_optimizer_state, load_full_optimizer_state
from astrai.serialization import Checkpoint, prune_checkpoints

BACKEND_STATE_KEY = "backend_state"  # the run's training matmuls decision (Backend.training_state), kept for a resume
OLD_BACKEND_STATE_KEY = "cpu_products"  # the same decision in checkpoints written before the backend registry


def seed_rng(seed: int) -> None:
    """Seed every stream a checkpoint keeps (torch, Python, NumPy): a fresh process starts Python's
    and NumPy's from the OS's entropy, so a strategy or callback drawing from them would make
    each run of one config, and each resumed piece of a run, different."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def capture_rng() -> dict:
    """All RNG streams as tensors and plain values (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])}}
    if torch.cuda.is_available():  # this rank's device only: a resume may see fewer or other GPUs
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]  # older checkpoints hold a list, one state per visible GPU
        torch.cuda.set_rng_state(cuda[0] if isinstance(cuda, (list, tuple)) else cuda)


def save_training_checkpoint(context, ckpt_dir: Path, keep: int) -> Path | None:
    """Gather the state on every rank (collective under FSDP), write it on rank 0, prune old saves."""
    weights = full_model_state(context.model)
    optimizer = full_optimizer_state(context.model, context.optimizer)
    strategy = context.strategy.state_dict()  # every rank: gathering sharded weights is collective
    path = Path(ckpt_dir) / f"step_{context.step:08d}"
    if context.is_main:
        trainer_state = {"step": context.step, "epoch": context.epoch, "batch_in_epoch": context.batch_in_epoch,
                         "tokens_seen": context.tokens_seen, "world_size": context.world_size, "rng": capture_rng()}
        meta = {"step": context.step, "tokens_seen": context.tokens_seen, "world_size": context.world_size,
                "train_config": context.config.to_dict(), BACKEND_STATE_KEY: context.backend_state}
        extra = {"optimizer": optimizer, "scheduler": context.scheduler.state_dict(), "trainer_state": trainer_state}
        if strategy:
            extra["strategy"] = strategy
        Checkpoint(weights, context.epoch, context.iteration, extra, meta).save(path)
        prune_checkpoints(ckpt_dir, keep)
    if dist.is_initialized():
        dist.barrier()
    return path if context.is_main else None


def recorded_backend_state(meta: dict):
    """The training matmuls decision a checkpoint's meta records (under its older name too), or None."""
    recorded = meta.get(BACKEND_STATE_KEY)
    return recorded if recorded is not None else meta.get(OLD_BACKEND_STATE_KEY)


def restore_training_state(context, checkpoint: Checkpoint) -> None:
    """Optimizer, schedule, counters and data position from ``checkpoint`` (weights are loaded earlier);
    its RNG streams wait in ``context.resume_rng`` for the loop."""
    extra = checkpoint.extra
    if "optimizer" in extra:
        load_full_optimizer_state(context.model, context.optimizer, extra["optimizer"])
    if "scheduler" in extra:
        context.scheduler.load_state_dict(extra["scheduler"])
    if "strategy" in extra:
        context.strategy.load_state_dict(extra["strategy"])
    state = extra.get("trainer_state")
    context.iteration = checkpoint.iteration
    context.epoch = checkpoint.epoch
    if state is None:
        return
    context.step = context.start_step = int(state["step"])
    context.batch_in_epoch = int(state["batch_in_epoch"])
    scale = int(state.get("world_size", 1)) / context.world_size
    context.batch_in_epoch = int(context.batch_in_epoch * scale)
    context.tokens_seen = int(state["tokens_seen"])
    context.resume_rng = state["rng"]  # restored by the loop after the start-up's own draws (Trainer._run_epoch)
