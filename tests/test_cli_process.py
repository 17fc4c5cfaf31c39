"""A compute verb asks the backend of its device to prepare the process before it runs
(astrai/cli.py's ``prepare_process``): on the CPU the allocator tuning, for a kind without a
backend nothing; a verb that only reads files prepares nothing."""

from __future__ import annotations

import pytest
import torch

from astrai.backends.cpu import tuning
from astrai.cli import main


@pytest.fixture
def tuned(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(tuning, "tune_process", lambda: calls.append(1))
    return calls


@pytest.mark.parametrize("device, expected", [("cpu", [1]), ("cpu:0", [1]), ("meta", []),
                                              ("auto", [] if torch.cuda.is_available() else [1])])
def test_a_compute_verb_prepares_the_process_for_its_device(tmp_path, tuned, device, expected):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--device", device, "--prompt", "hi"]) == 2
    assert tuned == expected


def test_a_verb_without_a_device_flag_prepares_for_the_automatic_choice(tuned):
    assert main(["train", "--max_steps", "1"]) == 2  # no training data: refused after the preparation
    assert tuned == ([] if torch.cuda.is_available() else [1])


def test_a_verb_that_runs_no_model_prepares_nothing(tmp_path, tuned):
    assert main(["model", "info", str(tmp_path / "missing")]) == 2
    assert tuned == []
