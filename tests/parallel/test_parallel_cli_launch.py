"""`astrai train` on 2 CPU processes, launched both ways the README gives: torchrun and --nprocs.

Each run must exit 0 (a rank that aborts while exiting fails it), write its checkpoint and
final model once, and log every step once (rank 0 only).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.cli import main

MODEL = {"vocab_size": 1000, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "dim_ffn": 64, "max_len": 64}
STEPS = 4


@pytest.fixture(scope="module")
def corpus(bundled_data, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("launch") / "data"
    assert main(["preprocess", str(bundled_data / "pretrain" / "valid_en.jsonl"), "-o", str(out),
                 "--tokenizer", str(tokenizer_dir), "--train_type", "seq"]) == 0
    return out


def train_args(corpus: Path, tokenizer_dir: Path, run_dir: Path) -> list[str]:
    return ["train", "--train_type", "seq", "--data_root_path", str(corpus), "--model_preset", "tiny",
            "--model_overrides", json.dumps(MODEL), "--tokenizer_path", str(tokenizer_dir), "--window_size", "32",
            "--batch_per_device", "2", "--max_steps", str(STEPS), "--ckpt_interval", str(STEPS),
            "--ckpt_dir", str(run_dir), "--no-progress_bar"]


def run_and_check(command: list[str], run_dir: Path) -> None:
    # torchrun writes its per-run directories (torchelastic_*) under TMPDIR: the test's own
    scratch = run_dir.parent / "tmp"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(scratch))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, STEPS + 1))
    meta = json.loads((run_dir / f"step_{STEPS:08d}" / "meta.json").read_text())["meta"]
    assert meta["world_size"] == 2 and meta["tokens_seen"] == STEPS * 2 * 2 * 32  # steps x batch x ranks x window
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_torchrun_launch(corpus, tokenizer_dir, tmp_path):
    run_dir = tmp_path / "run"
    # --standalone: torchrun picks and holds a free port for its rendezvous itself (a port
    # chosen here could be taken by another test before torchrun binds it)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run_and_check(torchrun + ["-m", "astrai"] + train_args(corpus, tokenizer_dir, run_dir), run_dir)


def test_nprocs_launch(corpus, tokenizer_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_and_check([sys.executable, "-m", "astrai"] + train_args(corpus, tokenizer_dir, run_dir)
                  + ["--nprocs", "2"], run_dir)  # no --master_port: the spawner takes a free one
