"""Leftovers of saves killed midway are cleared at the next start, without losing a finished checkpoint."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from astrai.serialization import Checkpoint, latest_checkpoint, remove_stale_saves
from astrai.trainer.callbacks.checkpointing import CheckpointCallback


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_training_start_removes_a_killed_saves_temporary_directory(tmp_path, killed_save):
    pid = killed_save(tmp_path)
    assert hidden(tmp_path) == [f".tmp-step_00000002-{pid}"]
    CheckpointCallback(str(tmp_path)).on_train_begin(SimpleNamespace(step=1, is_main=True))
    assert hidden(tmp_path) == []
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert torch.equal(Checkpoint.load(tmp_path / "step_00000001").state_dict["w"], torch.arange(6.0).reshape(2, 3))


def test_the_next_save_clears_leftovers_too(tmp_path):
    (tmp_path / f".tmp-step_00000002-{dead_pid()}").mkdir()
    Checkpoint({"w": torch.ones(2)}, 0, 3).save(tmp_path / "step_00000003")
    assert hidden(tmp_path) == []


def test_a_live_processs_save_in_progress_is_left_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        busy = tmp_path / f".tmp-step_00000009-{other.pid}"
        busy.mkdir()
        assert remove_stale_saves(tmp_path) == [] and busy.is_dir()
    finally:
        other.kill()
        other.wait()
    assert remove_stale_saves(tmp_path) == [busy] and not busy.exists()


def test_a_kill_between_the_two_renames_keeps_the_finished_checkpoint(tmp_path):
    finished = Checkpoint({"w": torch.full((2,), 7.0)}, 0, 5).save(tmp_path / "scratch")
    dead = dead_pid()
    os.rename(finished, tmp_path / f".tmp-step_00000005-{dead}")
    Checkpoint({"w": torch.zeros(2)}, 0, 4).save(tmp_path / "scratch")
    os.rename(tmp_path / "scratch", tmp_path / f".old-step_00000005-{dead}")
    remove_stale_saves(tmp_path)
    assert hidden(tmp_path) == [] and torch.equal(Checkpoint.load(tmp_path / "step_00000005").state_dict["w"],
                                                 torch.full((2,), 7.0))
    old_only = tmp_path / f".old-step_00000006-{dead}"
    os.rename(tmp_path / "step_00000005", old_only)
    remove_stale_saves(tmp_path)
    assert (tmp_path / "step_00000006" / "meta.json").is_file() and hidden(tmp_path) == []
