"""CheckpointCallback: periodic, final and emergency saves of the whole training state."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch.distributed as dist

from astrai.serialization import remove_stale_saves
from astrai.trainer.callbacks.base import CallbackFactory, TrainCallback
from astrai.trainer.state import save_training_checkpoint


@CallbackFactory.register("checkpoint")
class CheckpointCallback(TrainCallback):
    """Save every ``interval`` steps, at the end, and on SIGINT/SIGTERM or an exception.

    A signal only sets ``context.stop_requested``; the loop finishes the current step,
    this callback saves in on_train_end, and the run stops cleanly — so an interrupted
    run resumes exactly.
    """

    def __init__(self, save_dir: str, interval: int = 1000, keep: int = 3):
        self.save_dir, self.interval, self.keep = Path(save_dir), interval, keep
        self.last_saved_step = -1
        self._old_handlers: dict = {}

    def _save_checkpoint(self, context) -> None:
        if self.last_saved_step == context.step:
            return
        save_training_checkpoint(context, self.save_dir, self.keep)
        self.last_saved_step = context.step

    def on_train_begin(self, context) -> None:
        self.last_saved_step = context.step
        if context.is_main:  # a save killed midway leaves a temporary directory behind
            remove_stale_saves(self.save_dir)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old_handlers[sig] = signal.signal(sig, lambda *_: setattr(context, "stop_requested", True))

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def on_step_end(self, context) -> None:
        if context.step % self.interval == 0:
            self._save_checkpoint(context)

    def on_train_end(self, context) -> None:
        self._save_checkpoint(context)
        self._restore_handlers()

    def on_error(self, context) -> None:
        """Emergency save of the last completed step (single process only: peers may be gone)."""
        self._restore_handlers()
        if dist.is_initialized() and dist.get_world_size() > 1:
            return
        if context.step > 0:
            self._save_checkpoint(context)
