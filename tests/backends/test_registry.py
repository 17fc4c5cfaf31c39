"""The backend registry (astrai/backends/__init__.py): the device-neutral code gets the CPU
backend for a CPU device, the plain behaviour for a kind no backend registers ("meta"), and
whatever a backend registers for its kind, found by the kind alone."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import astrai.backends as backends
from astrai.backends import Backend, backend_for
from astrai.backends.cpu import training, tuning
from astrai.backends.cpu.runner import CpuModelRunner
from astrai.inference.cache import KVCache
from astrai.inference.engine import load_model
from astrai.inference.runner import ModelRunner
from astrai.inference.scheduler import create_runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))  # inference_helpers

from inference_helpers import make_model  # noqa: E402

CPU_PATHS = ("fused", "row_kernels", "batched", "torch")


class MetaRunner(ModelRunner):
    """A runner a test registers for the kind "meta"."""


def _runner_for(model: torch.nn.Module) -> ModelRunner:
    return create_runner(model, KVCache.for_model(model, num_pages=4, page_size=16, prefix_cache=False))


@pytest.fixture(scope="module")
def tiny():
    return make_model("tiny")


def test_a_cpu_device_gets_the_cpu_backend(tiny):
    for device in ("cpu", torch.device("cpu"), "cpu:0"):
        backend = backend_for(device)
        assert backend.kind == "cpu" and backend.runner_class() is CpuModelRunner
        assert backend.decode_paths == CPU_PATHS and backend.bf16_linears_only
    runner = _runner_for(tiny)
    assert type(runner) is CpuModelRunner and runner.decode_path_counts() == dict.fromkeys(CPU_PATHS, 0)


def test_the_cpu_backends_hooks_reach_its_functions(monkeypatch, tiny):
    calls = []
    monkeypatch.setattr(tuning, "tune_process", lambda: calls.append("tune"))
    monkeypatch.setattr(tuning, "release_thread_pool", lambda: calls.append("release"))
    monkeypatch.setattr(training, "agree_on_matmuls", lambda model, recorded: {"asked": recorded})
    backend = backend_for("cpu")
    backend.prepare_process()
    backend.release_idle()
    assert calls == ["tune", "release"]
    assert backend.training_state(tiny, {"forward": False}) == {"asked": {"forward": False}}
    with backend.training_matmuls(tiny, {"forward": True, "weight_grad": True}) as switched:
        assert switched > 0  # the linears run as OneDnnLinear within the block


def test_an_unregistered_kind_gets_the_plain_behaviour(monkeypatch, tiny):
    monkeypatch.setattr(tuning, "tune_process", lambda: pytest.fail("a CPU hook ran for meta"))
    monkeypatch.setattr(tuning, "release_thread_pool", lambda: pytest.fail("a CPU hook ran for meta"))
    backend = backend_for(torch.device("meta"))
    assert backend == Backend("meta")
    assert backend.runner_class() is None and backend.decode_paths == ("torch",) and not backend.bf16_linears_only
    backend.prepare_process()
    backend.release_idle()
    assert backend.training_state(tiny, {"forward": True, "weight_grad": True}) is None
    assert isinstance(backend.training_matmuls(tiny, None), contextlib.nullcontext)
    runner = _runner_for(make_model("tiny").to("meta"))
    assert type(runner) is ModelRunner and runner.decode_path_counts() == {"torch": 0}
    runner.release_idle()


def test_bf16_weights_keep_fp32_norms_only_where_the_backend_says_so(tmp_path, tiny):
    tiny.save_pretrained(tmp_path)
    on_cpu = load_model(tmp_path, torch.bfloat16, "cpu")
    assert on_cpu.norm.weight.dtype == torch.float32 and on_cpu.lm_head.weight.dtype == torch.bfloat16
    on_meta = load_model(tmp_path, torch.bfloat16, "meta")
    assert on_meta.norm.weight.dtype == torch.bfloat16


def test_what_a_backend_registers_for_its_kind_is_what_the_runner_gets(monkeypatch):
    monkeypatch.setitem(backends._BACKENDS, "meta", Backend("meta", runner=f"{__name__}:MetaRunner",
                                                             decode_paths=("graph", "torch")))
    runner = _runner_for(make_model("tiny").to("meta"))
    assert type(runner) is MetaRunner and runner.decode_path_counts() == {"graph": 0, "torch": 0}


def test_a_backend_must_count_the_plain_path():
    with pytest.raises(ValueError, match="torch"):
        Backend("meta", decode_paths=("graph",))


def test_the_kind_alone_finds_the_cpu_backend_without_loading_torch():
    """Asking for "cpu" imports its package, which registers itself; the process preparation
    the CLI makes before a verb runs stays free of torch."""
    code = ("import json, sys\n"
            "from astrai.backends import backend_for\n"
            "backend = backend_for('cpu')\n"
            "backend.prepare_process()\n"
            "print(json.dumps([backend.kind, backend.runner, 'torch' in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ASTRAI_TUNE_MALLOC": "0"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["cpu", "astrai.backends.cpu.runner:CpuModelRunner", False]
