"""Trainer: the epoch → step → micro-batch loop, with callbacks around every stage."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from astrai.backends import backend_for
from astrai.config import TrainConfig
from astrai.errors import ConfigError
from astrai.parallel import is_distributed, setup_parallel, spawn_parallel_fn, torchrun_env, unwrap_model
from astrai.parallel.setup import default_device_type
from astrai.parallel.wrap import no_sync
from astrai.serialization import Checkpoint
from astrai.trainer.builder import TrainContextBuilder, resolve_device
from astrai.trainer.callbacks import CallbackFactory, TrainCallback
from astrai.trainer.context import TrainContext
from astrai.trainer.state import recorded_backend_state, restore_rng

TOKEN_KEYS = ("input_ids", "chosen", "rejected", "prompts", "responses")


def batch_tokens(batch: dict) -> int:
    """Tokens a batch feeds the model: input_ids, or the sequences of preference/RL batches."""
    if "input_ids" in batch:
        return batch["input_ids"].numel()
    return sum(batch[k].numel() for k in TOKEN_KEYS if k in batch and torch.is_tensor(batch[k]))


class Trainer:
    """Runs a TrainConfig. Objects (model, datasets, tokenizer) may replace the config's paths.

    With ``nprocs > 1`` outside torchrun, ``train`` spawns that many local processes;
    under torchrun each process joins the group from the environment.
    """

    def __init__(self, train_config: TrainConfig, callbacks: Optional[list[TrainCallback]] = None,
                 model: Optional[nn.Module] = None, train_dataset: Optional[Dataset] = None,
                 val_dataset: Optional[Dataset] = None, tokenizer: Any = None, strategy_extra: Optional[dict] = None,
                 backend_state: Optional[dict] = None):
        """``backend_state`` pins the device backend's training matmuls decision (what an
        earlier run's ``TrainContext.backend_state`` recorded, astrai/backends'
        ``Backend.training_state``) instead of measuring it, so that a repeated run rounds as
        that one did; a resumed checkpoint's own decision comes first."""
        self.train_config = train_config
        self.backend_state = backend_state
        self.callbacks = list(callbacks or [])
        self.model, self.train_dataset, self.val_dataset, self.tokenizer = model, train_dataset, val_dataset, tokenizer
        self.strategy_extra = strategy_extra

    # --- entry points --------------------------------------------------------------
    def train(self, checkpoint: Optional[Checkpoint | str] = None) -> Optional[TrainContext]:
        """Train to the end; returns the final context (None in the parent of spawned workers)."""
        config = self.train_config
        env = torchrun_env()
        # the type only: resolving 'auto' to a device index would start CUDA in a parent that only spawns
        device_type = default_device_type() if config.device == "auto" else resolve_device(config).type
        if not is_distributed() and env is not None and env["world_size"] > 1:
            setup_parallel(env["rank"], env["world_size"], config.backend, env["master_addr"], env["master_port"],
                           device_type=device_type, local_rank=env["local_rank"])
        elif not is_distributed() and config.nprocs > 1:
            if device_type == "cuda" and config.nprocs > torch.cuda.device_count():
                raise ConfigError(f"TrainConfig.nprocs: {config.nprocs} processes but {torch.cuda.device_count()} "
                                  f"visible GPUs; one process per GPU (or --device cpu)")
            # Fail fast on bad configs before spawning. On the CPU: a build here on a GPU would put
            # the model on GPU 0 and hand every rank a CUDA-shared copy of it.
            self._build_context(checkpoint, replace(config, device="cpu"))
            spawn_parallel_fn(_train_in_worker, config.nprocs, self, checkpoint, backend=config.backend,
                              master_addr=config.master_addr, master_port=config.master_port, device_type=device_type)
            return None
        return self._run(self._build_context(checkpoint))

    def _build_context(self, checkpoint, config: Optional[TrainConfig] = None) -> TrainContext:
        builder = TrainContextBuilder(config or self.train_config, self.model, self.train_dataset, self.val_dataset,
                                      self.tokenizer, self.strategy_extra)
        return builder.with_checkpoint(checkpoint).build()

    def _get_default_callbacks(self) -> list[TrainCallback]:
        c = self.train_config
        names = [("gradient_checkpointing", {"modules": c.gradient_checkpointing_modules})] if c.gradient_checkpointing else []
        names += [("gradient_clipping", {"max_grad_norm": c.max_grad_norm}),
                  ("validation", {"interval": c.validation_interval, "max_batches": c.validation_batches}),
                  # the step's log line before its checkpoint: a run killed between the two resumes from
                  # the step before and writes the line again, so every checkpointed step has its line
                  ("metric_logger", {"log_dir": c.log_dir or c.ckpt_dir, "save_interval": c.log_interval}),
                  ("checkpoint", {"save_dir": c.ckpt_dir, "interval": c.ckpt_interval, "keep": c.ckpt_keep}),
                  ("progress_bar", {"enabled": c.progress_bar})]
        if c.save_final_model:
            names.append(("save_model", {"save_dir": str(Path(c.ckpt_dir) / "final")}))
        return [CallbackFactory.create(name, **kwargs) for name, kwargs in names]

    # --- the loop ------------------------------------------------------------------
    def _run(self, context: TrainContext) -> TrainContext:
        # the strategy's own bookkeeping first: a step is complete (and checkpointed) with it
        callbacks = context.strategy.callbacks() + self._get_default_callbacks() + self.callbacks

        def fire(hook: str) -> None:
            for callback in callbacks:
                getattr(callback, hook)(context)

        try:
            fire("on_train_begin")
            # the device backend's faster training matmuls, for this run only, decided once for all
            # ranks and kept across a resume: matmuls that round differently diverge
            model, backend = unwrap_model(context.model), backend_for(context.device)
            recorded = recorded_backend_state(context.checkpoint.meta) if context.checkpoint is not None else None
            recorded = recorded if recorded is not None else self.backend_state
            context.backend_state = backend.training_state(model, recorded)
            with backend.training_matmuls(model, context.backend_state):
                while not context.done and not context.stop_requested:
                    self._run_epoch(context, fire)
            fire("on_train_end")
        except BaseException as exc:
            context.error = exc
            for callback in callbacks:
                try:
                    callback.on_error(context)
                except Exception:  # the original error matters more than a failing handler
                    pass
            raise
        return context

    def _run_epoch(self, context: TrainContext, fire) -> None:
        accum = context.config.grad_accum_steps
        context.sampler.set_epoch(context.epoch, context.batch_in_epoch * context.config.batch_per_device)
        if context.batch_in_epoch == 0:
            fire("on_epoch_begin")
        batches = iter(context.dataloader)
        if context.resume_rng is not None:
            # only now: starting a run draws too (the loader's seed above, the matmuls' measurement),
            # and the saved step's streams must reach the next step as they did in the unbroken run
            restore_rng(context.resume_rng)
            context.resume_rng = None
        remaining = context.steps_per_epoch - context.batch_in_epoch // accum
        for _ in range(remaining):
            window = [next(batches) for _ in range(accum)]
            fire("on_step_begin")
            self._train_step(context, window, fire)
            context.step += 1
            context.batch_in_epoch += accum
            fire("on_step_end")
            if context.world_size > 1:
                flag = torch.tensor([float(context.stop_requested)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                context.stop_requested = bool(flag.item())
            if context.done or context.stop_requested:
                break
        if context.batch_in_epoch >= context.steps_per_epoch * accum:
            context.epoch += 1
            context.batch_in_epoch = 0
        elif not context.done:
            return  # stopped mid-epoch: the resumed run finishes this epoch and ends it
        fire("on_epoch_end")

    def _micro_batch_weights(self, context: TrainContext, window: list[dict]) -> list[float]:
        """Weights making Σ weight·mean_loss equal the mean over the whole window on all ranks.

        DDP/FSDP average gradients over ranks, hence the world-size factor; micro-batches
        with more loss-bearing tokens count for more, exactly as in one big batch.
        """
        units = [context.strategy.count_loss_units(b) for b in window]
        if any(u is None for u in units):
            return [1.0 / len(window)] * len(window)
        total = torch.tensor([float(sum(units))], dtype=torch.float64)
        if context.world_size > 1:
            dist.all_reduce(total)
        total = max(float(total), 1.0)
        return [u * context.world_size / total for u in units]

    def _train_step(self, context: TrainContext, window: list[dict], fire) -> None:
        model, strategy = context.model, context.strategy
        weights = self._micro_batch_weights(context, window)
        # kept on the device and read once per optimizer step: a host read per micro-batch
        # would make the CPU wait for each one's kernels before queueing the next
        step_loss = torch.zeros((), dtype=torch.float64, device=context.device)
        use_autocast = context.autocast_dtype is not None
        for i, (batch, weight) in enumerate(zip(window, weights)):
            context.batch = batch
            fire("on_batch_begin")
            with no_sync(model, skip=i < len(window) - 1):
                with torch.autocast(context.device.type, dtype=context.autocast_dtype or torch.float32,
                                    enabled=use_autocast):
                    loss = strategy.compute_loss(batch)
                (loss * weight).backward()
            step_loss += loss.detach().to(torch.float64) * weight
            context.micro_loss_tensor = loss.detach()
            context.iteration += 1
            context.tokens_seen += batch_tokens(batch) * context.world_size
            fire("on_batch_end")
        if context.world_size > 1:
            dist.all_reduce(step_loss)
        context.loss = float(step_loss) / context.world_size
        context.metrics = host_values(strategy.metrics)
        router_stats = getattr(unwrap_model(model), "router_stats", None)
        context.router_stats = router_stats() if callable(router_stats) else {}
        fire("on_optimizer_step")
        context.optimizer.step()
        context.scheduler.step()
        context.optimizer.zero_grad(set_to_none=True)
        context.batch = None


def host_values(metrics: dict) -> dict:
    """Strategies may leave their metrics as 0-d tensors where they were computed; read
    them to Python floats with one transfer per device instead of one each."""
    out = dict(metrics)
    by_device: dict[torch.device, list[str]] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(name)
    for names in by_device.values():
        values = torch.stack([metrics[n].detach().reshape(()).to(torch.float64) for n in names]).tolist()
        out.update(zip(names, values))
    return out


def _train_in_worker(trainer: Trainer, checkpoint) -> None:
    if trainer.model is not None:
        # spawn hands every process the model's tensors in one shared-memory block: without a private
        # copy each rank's optimizer would update the same weights, every step once per rank
        trainer.model = copy.deepcopy(trainer.model)
    trainer._run(trainer._build_context(checkpoint))
