"""Subprocess for the resume tests: train until a signal at a chosen moment kills or stops the run.

Usage: python resume_worker.py <tmp_dir> <ckpt_interval> <signal name> <moment> <step>

``moment`` is ``step`` (the signal at the end of that step, after its callbacks) or ``saved``
(the instant that step's checkpoint has landed, before any later callback runs).
The run's strategy draws from the torch, Python and NumPy RNGs on every micro-batch and lets
the draws weigh its loss and appear in its metrics, so a stream resumed in another state shows
in the log and the weights.
"""

import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from trainer_helpers import TokenWindows, config, tiny_model

from astrai.serialization import latest_checkpoint
from astrai.trainer import TrainCallback, Trainer
from astrai.trainer.callbacks import checkpointing
from astrai.trainer.strategies import StrategyFactory
from astrai.trainer.strategies.seq import SEQStrategy

RUN = dict(max_steps=8, grad_accum_steps=2, n_epoch=1, val_fraction=0.25, validation_interval=4,
           save_final_model=False, max_lr=3e-3, warmup_ratio=0.25, train_type="seq_draws", ckpt_keep=100)


@StrategyFactory.register("seq_draws")
class DrawingStrategy(SEQStrategy):
    """SEQ whose loss is scaled by draws from every RNG stream a checkpoint keeps."""

    def compute_loss(self, batch):
        draws = {"torch_draw": float(torch.rand(())), "python_draw": random.random(),
                 "numpy_draw": float(np.random.rand())}
        self.metrics = dict(draws)
        return super().compute_loss(batch) * (1.0 + 0.1 * sum(draws.values()))


class SignalAt(TrainCallback):
    def __init__(self, sig, step):
        self.sig, self.step = sig, step

    def on_step_end(self, context):
        if context.step == self.step:
            os.kill(os.getpid(), self.sig)


def signal_after_save(sig, step):
    """Send ``sig`` as soon as the checkpoint of ``step`` is on disk, whatever runs after it."""
    real_save = checkpointing.save_training_checkpoint

    def save_then_signal(context, *args, **kwargs):
        path = real_save(context, *args, **kwargs)
        if context.step == step:
            os.kill(os.getpid(), sig)
        return path

    checkpointing.save_training_checkpoint = save_then_signal


def run(tmp_dir, ckpt_interval=3, callbacks=(), checkpoint=None):
    return Trainer(config(Path(tmp_dir), ckpt_interval=ckpt_interval, **RUN), callbacks=list(callbacks),
                   model=tiny_model(), train_dataset=TokenWindows(n=48)).train(checkpoint)


if __name__ == "__main__":
    tmp, interval, sig, moment, step = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3]), sys.argv[4], int(sys.argv[5])
    callbacks = []
    if moment == "saved":
        signal_after_save(sig, step)
    else:
        callbacks.append(SignalAt(sig, step))
    latest = latest_checkpoint(Path(tmp) / "ckpt")
    run(tmp, interval, callbacks, None if latest is None else str(latest))
