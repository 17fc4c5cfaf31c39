"""Shared fixtures: the bundled data directory and a small tokenizer trained on it.

The tokenizer is trained once per session on the first documents of the bundled
bilingual corpus (about a second on one core), so every area's tests use a real
byte-level BPE vocabulary with astrai's special tokens, without any download.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_DATA = REPO_ROOT / "data"
TOKENIZER_VOCAB_SIZE = 1000
TOKENIZER_TRAINING_DOCS = 600
SAVE_KILLER = REPO_ROOT / "tests" / "trainer" / "save_killer_worker.py"


def _training_texts(limit: int):
    with open(BUNDLED_DATA / "pretrain" / "train.jsonl", encoding="utf-8") as handle:
        for i, line in enumerate(handle):
            if i >= limit:
                break
            yield json.loads(line)["text"]


@pytest.fixture(scope="session")
def bundled_data() -> Path:
    """Path of the repository's data/ directory."""
    return BUNDLED_DATA


@pytest.fixture(scope="session")
def tokenizer():
    """A byte-level BPE tokenizer (vocab 1000) trained on the bundled zh/en corpus."""
    from astrai.tokenize import AutoTokenizer

    return AutoTokenizer.train(_training_texts(TOKENIZER_TRAINING_DOCS), TOKENIZER_VOCAB_SIZE, show_progress=False)


@pytest.fixture(scope="session")
def tokenizer_dir(tokenizer, tmp_path_factory) -> Path:
    """A directory holding the session tokenizer's tokenizer.json + tokenizer_config.json."""
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def killed_save():
    """``killed_save(root)``: save checkpoint step_1 under ``root`` in another process, start step_2
    and SIGKILL that process halfway through its save; returns the dead process's id."""

    def kill(root: Path) -> int:
        proc = subprocess.Popen([sys.executable, str(SAVE_KILLER), str(root)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "saving"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        return proc.pid

    return kill


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run first: one of them takes minutes on a slow CPU, and under
    pytest-xdist a long test handed out last keeps the run going after the other workers are done."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="device for the tests under tests/device (cpu, cuda, cuda:1, ...): the paths a GPU takes")


@pytest.fixture(scope="session")
def device(request):
    """The torch.device of ``--device``; a GPU asked for must be visible (it is never skipped)."""
    import torch

    device = torch.device(request.config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: no CUDA device is visible")
    return device
