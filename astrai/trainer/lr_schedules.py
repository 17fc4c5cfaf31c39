"""Learning-rate schedules as multipliers of each parameter group's base lr.

Every schedule is a pure function ``factor(step)`` of the optimizer-step count, so
the formulas are testable in isolation and resuming only needs ``last_epoch``.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from astrai.factory import BaseFactory


class BaseScheduler(LRScheduler):
    """lr(step) = base_lr · factor(step); ``step()`` is called once per optimizer step."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps


def _cosine(progress: float, min_rate: float) -> float:
    return min_rate + (1 - min_rate) * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


class SchedulerFactory(BaseFactory[BaseScheduler]):
    """schedule_type → scheduler ('cosine', 'sgdr', 'wsd', 'constant')."""

    kind = "schedule"

    @classmethod
    def create(cls, optimizer: Optimizer, schedule_type: str, **kwargs) -> BaseScheduler:
        return cls._registry.get(schedule_type)(optimizer, **kwargs)


@SchedulerFactory.register("constant")
class ConstantScheduler(BaseScheduler):
    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0, last_epoch: int = -1, **_: object):
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        return _warmup(step, self.warmup_steps) if step < self.warmup_steps else 1.0


@SchedulerFactory.register("cosine")
class CosineScheduler(BaseScheduler):
    """Linear warmup to the peak over ``warmup_steps``, then cosine down to ``min_rate``
    of the peak over ``lr_decay_steps``; flat at ``min_rate`` afterwards."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, lr_decay_steps: int, min_rate: float = 0.1,
                 last_epoch: int = -1, **_: object):
        self.warmup_steps, self.lr_decay_steps, self.min_rate = warmup_steps, max(1, lr_decay_steps), min_rate
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        return _cosine((step - self.warmup_steps) / self.lr_decay_steps, self.min_rate)


@SchedulerFactory.register("sgdr")
class SGDRScheduler(BaseScheduler):
    """Warmup, then cosine cycles restarting at the peak; each cycle ``t_mult`` times
    longer than the last (the first lasts ``cycle_length`` steps)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, cycle_length: int, min_rate: float = 0.1,
                 t_mult: int = 2, last_epoch: int = -1, **_: object):
        self.warmup_steps, self.cycle_length, self.min_rate, self.t_mult = warmup_steps, max(1, cycle_length), min_rate, t_mult
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        t, length = step - self.warmup_steps, self.cycle_length
        while t >= length:
            t -= length
            length *= self.t_mult
        return _cosine(t / length, self.min_rate)


@SchedulerFactory.register("wsd")
class WSDScheduler(BaseScheduler):
    """Warmup-stable-decay: warmup, hold the peak, then decay linearly to ``min_rate``
    over the last ``decay_steps`` of ``total_steps`` (the token-budget schedule)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int, decay_steps: int,
                 min_rate: float = 0.0, last_epoch: int = -1, **_: object):
        self.warmup_steps, self.total_steps, self.decay_steps, self.min_rate = warmup_steps, total_steps, decay_steps, min_rate
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        decay_start = self.total_steps - self.decay_steps
        if step < decay_start or self.decay_steps <= 0:
            return 1.0
        progress = min(1.0, (step - decay_start) / self.decay_steps)
        return 1.0 - (1.0 - self.min_rate) * progress


def scheduler_kwargs(config, total_steps: int) -> dict:
    """The factory arguments a TrainConfig implies for ``total_steps`` optimizer steps."""
    warmup = int(round(config.warmup_ratio * total_steps))
    after = max(1, total_steps - warmup)
    return {"warmup_steps": warmup, "lr_decay_steps": after, "min_rate": config.min_rate, "total_steps": total_steps,
            "decay_steps": int(round(config.decay_ratio * total_steps)), "t_mult": config.sgdr_t_mult,
            "cycle_length": max(1, int(round(config.sgdr_cycle_ratio * after)))}


def resize_schedule(scheduler: BaseScheduler, config, total_steps: int) -> None:
    """Give a running schedule the lengths it would have had if built for ``total_steps``,
    keeping its step count: a run that times its first steps can stretch or shrink its plan
    in place instead of starting over. The optimizer's rate follows at once."""
    for name, value in scheduler_kwargs(config, total_steps).items():
        if name not in ("min_rate", "t_mult") and hasattr(scheduler, name):
            setattr(scheduler, name, max(1, value) if name in ("lr_decay_steps", "cycle_length") else value)
    rates = scheduler.get_lr()
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = list(rates)
