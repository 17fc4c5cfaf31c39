"""The engine releases idle OpenMP pools: the submitting thread's and its own when idle."""

from __future__ import annotations

import threading
import time

import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference import openmp, scheduler


def test_release_reaches_torchs_libgomp():
    if "OpenMP" not in torch.__config__.parallel_info():
        return  # another runtime: nothing to release, by design
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        (a @ a).sum()  # a parallel op: this thread now holds a pool of workers
        assert openmp.release_thread_pool() is True
        assert torch.allclose((a @ a).sum(), (a @ a).sum())  # the pool is rebuilt on demand
    finally:
        torch.set_num_threads(threads)


def test_engine_releases_caller_and_idle_loop(gqa_model, monkeypatch):
    callers: list[str] = []
    monkeypatch.setattr(scheduler, "release_thread_pool", lambda: callers.append(threading.current_thread().name))
    with InferenceEngine(gqa_model, None, max_batch_size=2, num_pages=16) as engine:
        result = engine.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)).result()
        assert len(result.token_ids) == 3
        deadline = time.monotonic() + 5
        while "astrai-scheduler" not in callers and time.monotonic() < deadline:
            time.sleep(0.01)
    assert threading.current_thread().name in callers  # submit released the caller's pool
    assert "astrai-scheduler" in callers  # the loop released its own before waiting idle
