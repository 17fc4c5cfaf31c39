"""Subprocess: save checkpoint step_1, then hang inside the save of step_2 until killed.

Usage: python save_killer_worker.py <ckpt_dir>
"""

import sys
import time
from pathlib import Path

import torch

from astrai.serialization import Checkpoint
from astrai.serialization import checkpoint as checkpoint_module

if __name__ == "__main__":
    root = Path(sys.argv[1])
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    Checkpoint(state, 0, 1, {"optimizer": {"lr": 0.1}}, {"step": 1}).save(root / "step_00000001")
    real_save = torch.save

    def slow_save(obj, path):
        real_save(obj, path)
        print("saving", flush=True)
        time.sleep(60)

    checkpoint_module.torch.save = slow_save
    Checkpoint({"w": torch.zeros(2, 3)}, 0, 2, {"optimizer": {"lr": 0.2}}, {"step": 2}).save(root / "step_00000002")
