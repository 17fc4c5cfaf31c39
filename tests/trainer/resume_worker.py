"""Subprocess for the resume tests: train until a signal at a chosen step kills or stops the run.

Usage: python resume_worker.py <tmp_dir> <signal name> <step>
"""

import os
import signal
import sys
from pathlib import Path

from trainer_helpers import TokenWindows, config, tiny_model

from astrai.trainer import TrainCallback, Trainer

RUN = dict(max_steps=8, ckpt_interval=3, grad_accum_steps=2, n_epoch=1, val_fraction=0.25, validation_interval=4,
           save_final_model=False, max_lr=3e-3, warmup_ratio=0.25)


class SignalAt(TrainCallback):
    def __init__(self, sig, step):
        self.sig, self.step = sig, step

    def on_step_end(self, context):
        if context.step == self.step:
            os.kill(os.getpid(), self.sig)


def run(tmp_dir, callbacks=(), checkpoint=None):
    return Trainer(config(Path(tmp_dir), **RUN), callbacks=list(callbacks), model=tiny_model(),
                   train_dataset=TokenWindows(n=48)).train(checkpoint)


if __name__ == "__main__":
    tmp, sig, step = sys.argv[1], getattr(signal, sys.argv[2]), int(sys.argv[3])
    run(tmp, [SignalAt(sig, step)])
