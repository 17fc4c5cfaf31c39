"""Process-group set-up without a second process: backend choice, device checks, leaving the group.

Why cleanup_parallel idles (a rank aborting after its work was done) is in its docstring; the
two-process runs in this folder are where such an abort would show.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from astrai.errors import ConfigError
from astrai.parallel import cleanup_parallel, is_distributed
from astrai.parallel import setup as parallel_setup
from astrai.parallel.setup import resolve_backend
from astrai.trainer import Trainer
from astrai.trainer import trainer as trainer_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "trainer"))
from trainer_helpers import TokenWindows, config, tiny_model  # noqa: E402


def test_cleanup_destroys_the_group_then_settles(tmp_path, monkeypatch):
    events = []
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (events.append("destroy"), destroy()))
    monkeypatch.setattr(parallel_setup.time, "sleep", lambda seconds: events.append(("sleep", seconds)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(4))  # a finished collective for the workers to release
        cleanup_parallel()
    finally:
        if is_distributed():
            destroy()
    assert not is_distributed()
    assert events == ["destroy", ("sleep", parallel_setup.BACKEND_SETTLE_SECONDS)]
    assert parallel_setup.BACKEND_SETTLE_SECONDS >= 0.05


def test_cleanup_outside_a_group_does_nothing(monkeypatch):
    monkeypatch.setattr(parallel_setup.time, "sleep", lambda seconds: (_ for _ in ()).throw(AssertionError("slept")))
    cleanup_parallel()
    assert not is_distributed()


def test_backend_on_gpus_also_serves_cpu_tensors():
    # the trainer all-reduces small CPU tensors (loss, token counts, stop flag) even on GPUs
    assert resolve_backend("auto", "cuda") == "cpu:gloo,cuda:nccl"
    assert resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("nccl", "cuda") == "nccl"


def test_more_processes_than_gpus_is_refused_before_spawning(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "spawn_parallel_fn", lambda *a, **k: pytest.fail("spawned"))
    cfg = config(tmp_path, max_steps=1, nprocs=2, device="cuda")
    with pytest.raises(ConfigError, match="nprocs: 2 processes but 0 visible GPUs"):
        Trainer(cfg, model=tiny_model(), train_dataset=TokenWindows(n=8)).train()


def test_bad_device_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="TrainConfig.device: 'gpu'"):
        Trainer(config(tmp_path, max_steps=1, device="gpu"), model=tiny_model(), train_dataset=TokenWindows(n=8)).train()


def test_parent_checks_the_config_on_the_cpu_and_ranks_get_the_device(tmp_path, monkeypatch):
    """Before spawning on GPUs the parent builds once to fail fast; on the CPU, or it would hold
    the model on GPU 0 (here, with no GPU, moving it there would raise)."""
    spawned = {}
    monkeypatch.setattr(trainer_module.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(trainer_module, "spawn_parallel_fn", lambda fn, n, *a, **k: spawned.update(n=n, **k))
    model = tiny_model()
    Trainer(config(tmp_path, max_steps=1, nprocs=2, device="cuda"), model=model, train_dataset=TokenWindows(n=8)).train()
    assert spawned["n"] == 2 and spawned["device_type"] == "cuda" and spawned["backend"] == "auto"
    assert next(model.parameters()).device == torch.device("cpu")
