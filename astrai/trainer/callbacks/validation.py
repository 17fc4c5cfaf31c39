"""ValidationCallback: the strategy's loss on a fixed held-out set, every N steps and at the end."""

from __future__ import annotations

import torch
import torch.distributed as dist

from astrai.trainer.callbacks.base import CallbackFactory, TrainCallback


def evaluate(context, max_batches: int) -> float:
    """Token-weighted mean loss over the first ``max_batches`` validation batches (all ranks)."""
    model, strategy = context.model, context.strategy
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), torch.autocast(context.device.type, dtype=context.autocast_dtype or torch.float32,
                                         enabled=context.autocast_dtype is not None):
        for i, batch in enumerate(context.val_loader):
            if i >= max_batches:
                break
            units = strategy.count_loss_units(batch) or 1
            loss = strategy.compute_loss(batch)
            total += torch.tensor([float(loss) * units, units], dtype=torch.float64)
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


@CallbackFactory.register("validation")
class ValidationCallback(TrainCallback):
    """Sets ``context.val_loss`` on validation steps (None otherwise) for the logger to record."""

    def __init__(self, interval: int = 0, max_batches: int = 8):
        self.interval, self.max_batches = interval, max_batches

    def on_step_end(self, context) -> None:
        context.val_loss = None
        if context.val_loader is None:
            return
        due = (self.interval and context.step % self.interval == 0) or context.done
        if due:
            context.val_loss = evaluate(context, self.max_batches)
