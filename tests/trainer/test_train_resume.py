"""Resume is bit-for-bit: N steps straight == N/2, kill (or SIGTERM), resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from resume_worker import run

from astrai.serialization import Checkpoint, latest_checkpoint, list_checkpoints

HERE = Path(__file__).parent


def losses(tmp_dir):
    lines = (Path(tmp_dir) / "ckpt" / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r.get("val_loss")) for r in map(json.loads, lines)]


def interrupted_run(tmp_dir, sig, step):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, str(HERE / "resume_worker.py"), str(tmp_dir), sig, str(step)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    context = run(tmp)
    weights = {k: v.clone() for k, v in context.model.state_dict().items()}
    return losses(tmp), weights


@pytest.mark.parametrize("sig,step,saved", [("SIGKILL", 5, 3), ("SIGTERM", 4, 4)])
def test_kill_and_resume_matches_straight_run(tmp_path, straight, sig, step, saved):
    straight_losses, straight_weights = straight
    proc = interrupted_run(tmp_path, sig, step)
    if sig == "SIGKILL":
        assert proc.returncode == -9
    else:
        assert proc.returncode == 0, proc.stderr  # SIGTERM: emergency save, clean stop
    latest = latest_checkpoint(tmp_path / "ckpt")
    assert latest is not None and latest.name == f"step_{saved:08d}"
    context = run(tmp_path, checkpoint=str(latest))
    assert context.step == 8
    assert losses(tmp_path) == straight_losses  # every step, bit for bit (float equality)
    for name, tensor in context.model.state_dict().items():
        assert torch.equal(tensor, straight_weights[name]), name


def test_checkpoints_are_pruned_and_carry_config(tmp_path):
    run(tmp_path)
    names = [p.name for p in list_checkpoints(tmp_path / "ckpt")]
    assert names == ["step_00000003", "step_00000006", "step_00000008"]
    ckpt = Checkpoint.load(tmp_path / "ckpt" / "step_00000006")
    assert ckpt.meta["train_config"]["ckpt_interval"] == 3
    assert ckpt.meta["tokens_seen"] == 6 * 2 * 2 * 16
    assert set(ckpt.extra) == {"optimizer", "scheduler", "trainer_state"}
