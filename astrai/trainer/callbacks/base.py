"""TrainCallback and CallbackFactory: hooks into the training loop.

Hook order per optimizer step: on_batch_begin/on_batch_end for each micro-batch,
on_optimizer_step (gradients complete, before ``optimizer.step``: clipping, gradient
inspection), then on_step_end (weights updated, counters advanced: validation,
checkpoints, logging). on_epoch_begin/on_epoch_end bracket epochs, on_train_begin/
on_train_end the run, and on_error fires when the loop raises.
"""

from __future__ import annotations

from astrai.factory import BaseFactory


class TrainCallback:
    """Base class with every hook a no-op; override the ones you need."""

    def on_train_begin(self, context) -> None: ...

    def on_train_end(self, context) -> None: ...

    def on_epoch_begin(self, context) -> None: ...

    def on_epoch_end(self, context) -> None: ...

    def on_batch_begin(self, context) -> None: ...

    def on_batch_end(self, context) -> None: ...

    def on_optimizer_step(self, context) -> None: ...

    def on_step_begin(self, context) -> None: ...

    def on_step_end(self, context) -> None: ...

    def on_error(self, context) -> None: ...


class CallbackFactory(BaseFactory[TrainCallback]):
    """name → callback class ('checkpoint', 'metric_logger', 'progress_bar', ...)."""

    kind = "callback"
