"""Resume is bit-for-bit: a run killed (or stopped with SIGTERM) any number of times and resumed
gives the uninterrupted run's weights, the same metrics.jsonl line for line (every step once,
the strategy's random draws included) and the same RNG streams in its last checkpoint."""

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
VARYING = ("tokens_per_s",)  # a wall-clock rate, the only field allowed to differ


def records(tmp_dir):
    lines = (Path(tmp_dir) / "ckpt" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in VARYING} for line in lines]


def final_state(tmp_dir):
    """The weights and the trainer state (counters and RNG streams) of the run's last checkpoint."""
    checkpoint = Checkpoint.load(latest_checkpoint(Path(tmp_dir) / "ckpt"))
    return checkpoint.state_dict, checkpoint.extra["trainer_state"]


def interrupted_run(tmp_dir, interval, sig, moment, step):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, str(HERE / "resume_worker.py"), str(tmp_dir), str(interval), sig, moment,
                           str(step)], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted runs, checkpointing every 3 steps and every step."""
    out = {}
    for interval in (3, 1):
        tmp = tmp_path_factory.mktemp(f"straight{interval}")
        run(tmp, interval)
        out[interval] = records(tmp), final_state(tmp)
    return out


def assert_same_run(tmp_dir, straight_run):
    straight_records, (straight_weights, straight_trainer) = straight_run
    got = records(tmp_dir)
    assert [r["step"] for r in got] == list(range(1, 9))  # every step once
    assert got == straight_records  # losses, lr, grad norms and the draws, bit for bit
    weights, trainer = final_state(tmp_dir)
    for name, tensor in straight_weights.items():
        assert torch.equal(weights[name], tensor), name
    rng, straight_rng = trainer.pop("rng"), straight_trainer["rng"]
    assert trainer == {k: v for k, v in straight_trainer.items() if k != "rng"}
    assert torch.equal(rng["torch"], straight_rng["torch"])
    assert rng["python"] == straight_rng["python"]
    assert torch.equal(rng["numpy"]["keys"], straight_rng["numpy"]["keys"])
    assert {k: v for k, v in rng["numpy"].items() if k != "keys"} == \
           {k: v for k, v in straight_rng["numpy"].items() if k != "keys"}


@pytest.mark.parametrize("sig,step,saved", [("SIGKILL", 5, 3), ("SIGTERM", 4, 4)])
def test_kill_and_resume_matches_straight_run(tmp_path, straight, sig, step, saved):
    proc = interrupted_run(tmp_path, 3, sig, "step", step)
    if sig == "SIGKILL":
        assert proc.returncode == -9
    else:
        assert proc.returncode == 0, proc.stderr  # SIGTERM: emergency save, clean stop
    latest = latest_checkpoint(tmp_path / "ckpt")
    assert latest is not None and latest.name == f"step_{saved:08d}"
    context = run(tmp_path, 3, checkpoint=str(latest))
    assert context.step == 8
    assert_same_run(tmp_path, straight[3])


def test_repeated_kills_with_a_checkpoint_every_step_lose_no_line_and_no_draw(tmp_path, straight):
    """Killed the instant a checkpoint lands (before anything after it in the step), killed at a
    step's end, stopped by SIGTERM: each run resumes from the last checkpoint, and the whole
    reads as the unbroken run."""
    for sig, moment, step, code in (("SIGKILL", "saved", 2, -9), ("SIGKILL", "saved", 3, -9),
                                    ("SIGKILL", "step", 5, -9), ("SIGTERM", "step", 6, 0)):
        proc = interrupted_run(tmp_path, 1, sig, moment, step)
        assert proc.returncode == code, proc.stderr
        assert latest_checkpoint(tmp_path / "ckpt").name == f"step_{step:08d}"
    run(tmp_path, 1, checkpoint=str(latest_checkpoint(tmp_path / "ckpt")))
    assert_same_run(tmp_path, straight[1])


def test_checkpoints_are_pruned_and_carry_config(tmp_path):
    from trainer_helpers import TokenWindows, config, tiny_model

    from astrai.trainer import Trainer

    Trainer(config(tmp_path, max_steps=8, ckpt_interval=3, grad_accum_steps=2, save_final_model=False),
            model=tiny_model(), train_dataset=TokenWindows(n=48)).train()
    names = [p.name for p in list_checkpoints(tmp_path / "ckpt")]
    assert names == ["step_00000003", "step_00000006", "step_00000008"]
    ckpt = Checkpoint.load(tmp_path / "ckpt" / "step_00000006")
    assert ckpt.meta["train_config"]["ckpt_interval"] == 3
    assert ckpt.meta["tokens_seen"] == 6 * 2 * 2 * 16
    assert set(ckpt.extra) == {"optimizer", "scheduler", "trainer_state"}
