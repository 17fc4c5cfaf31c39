"""Process tuning is one explicit call (astrai/backends/cpu/tuning.py): applied on Linux/glibc when
asked, switchable off, and never by building an engine or a trainer; the CPU runner releases
idle OpenMP pools, the submitting thread's and its own when idle."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from astrai.backends.cpu import tuning
from astrai.inference import InferenceEngine, SamplingParams

CALL = "import astrai.backends.cpu as cpu; print(cpu.tune_process(), cpu.tune_process())"

def _run(code: str, tune: str = "1") -> str:
    env = {**os.environ, "ASTRAI_TUNE_MALLOC": tune}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or "musl" in (ctypes.util.find_library("c") or ""),
                           reason="mallopt is glibc's")


@glibc
def test_tuning_applies_once_when_called_and_can_be_disabled():
    assert _run(CALL) == "True True"
    assert _run(CALL, tune="0") == "False False"


def test_building_an_engine_or_a_trainer_changes_no_process_state(gqa_model, monkeypatch):
    from astrai.config import TrainConfig
    from astrai.trainer import Trainer

    calls = []
    monkeypatch.setattr(tuning, "tune_process", lambda: calls.append(1))
    environ, threads = dict(os.environ), torch.get_num_threads()
    InferenceEngine(gqa_model, None, num_pages=8).shutdown()
    Trainer(TrainConfig())
    assert not calls and dict(os.environ) == environ and torch.get_num_threads() == threads


def test_release_reaches_torchs_libgomp():
    if "OpenMP" not in torch.__config__.parallel_info():
        return  # another runtime: nothing to release, by design
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        (a @ a).sum()  # a parallel op: this thread now holds a pool of workers
        assert tuning.release_thread_pool() is True
        assert torch.allclose((a @ a).sum(), (a @ a).sum())  # the pool is rebuilt on demand
    finally:
        torch.set_num_threads(threads)


def test_engine_releases_caller_and_idle_loop(gqa_model, monkeypatch):
    callers: list[str] = []
    monkeypatch.setattr(tuning, "release_thread_pool", lambda: callers.append(threading.current_thread().name))
    with InferenceEngine(gqa_model, None, max_batch_size=2, num_pages=16) as engine:
        result = engine.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)).result()
        assert len(result.token_ids) == 3
        deadline = time.monotonic() + 5
        while "astrai-scheduler" not in callers and time.monotonic() < deadline:
            time.sleep(0.01)
    assert threading.current_thread().name in callers  # submit released the caller's pool
    assert "astrai-scheduler" in callers  # the loop released its own before waiting idle


def test_the_thread_that_builds_an_engine_releases_its_pool(gqa_model, monkeypatch):
    """A server builds its engine on a loader thread that lives on and never submits: the
    engine releases that thread's pool when it is built (kept, it made every step of the
    loop pay OpenMP's throttled wake-ups: 64 served requests ran 1.2x longer)."""
    callers: list[str] = []
    monkeypatch.setattr(tuning, "release_thread_pool", lambda: callers.append(threading.current_thread().name))
    built = []
    loader = threading.Thread(target=lambda: built.append(InferenceEngine(gqa_model, None, num_pages=8)),
                              name="loader")
    loader.start()
    loader.join()
    try:
        assert "loader" in callers
    finally:
        built[0].shutdown()
