"""TrainContext: the state of a run that the loop and every callback share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from astrai.config import TrainConfig
from astrai.serialization import Checkpoint
from astrai.trainer.lr_schedules import resize_schedule
from astrai.trainer.mixture import MixtureSampler
from astrai.trainer.strategies import BaseStrategy


@dataclass
class TrainContext:
    """Everything a callback may read; counters are updated by the loop.

    ``step`` counts optimizer steps, ``iteration`` micro-batches, ``batch_in_epoch``
    the micro-batches of the current epoch consumed up to the last completed step
    (what a checkpoint records, so resuming restarts on a step boundary).
    """

    config: TrainConfig
    model: nn.Module
    strategy: BaseStrategy
    optimizer: torch.optim.Optimizer
    scheduler: Any
    dataloader: DataLoader
    sampler: MixtureSampler
    device: torch.device
    total_steps: int
    steps_per_epoch: int
    tokens_per_step: int
    log_dir: Path
    val_loader: Optional[DataLoader] = None
    checkpoint: Optional[Checkpoint] = None
    autocast_dtype: Optional[torch.dtype] = None
    tokenizer: Any = None
    rank: int = 0
    world_size: int = 1
    epoch: int = 0
    iteration: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    start_step: int = 0
    batch: Optional[dict] = None
    loss: Optional[float] = None
    micro_loss_tensor: Optional[torch.Tensor] = None  # the last micro-batch's loss, left on its device
    grad_norm: Optional[float] = None
    val_loss: Optional[float] = None
    router_stats: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    stop_requested: bool = False
    error: Optional[BaseException] = None
    backend_state: Optional[dict] = None  # the run's training matmuls decision (its device's Backend.training_state)
    # a checkpoint's RNG streams, restored by the loop just before the resumed run's first step
    resume_rng: Optional[dict] = None

    @property
    def micro_loss(self) -> Optional[float]:
        """The last micro-batch's loss (reading it waits for that micro-batch's kernels)."""
        return None if self.micro_loss_tensor is None else float(self.micro_loss_tensor)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def resize(self, total_steps: int) -> None:
        """End the run after ``total_steps`` optimizer steps, its learning-rate schedule
        stretched or shrunk to that length from the current step on."""
        resize_schedule(self.scheduler, self.config, total_steps)
        self.total_steps = total_steps
