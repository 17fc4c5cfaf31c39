"""Process-group set-up: torchrun environment detection, local spawning, rank helpers.

Every distributed entry point goes through ``setup_parallel`` so the backend choice
(gloo on CPU, NCCL on GPU) and device pinning live in one place.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_current_device() -> torch.device:
    """This rank's device: cuda:<local rank> on GPU machines, cpu otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def torchrun_env() -> Optional[dict[str, Any]]:
    """rank/world size/local rank/master address from torchrun's variables, or None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": int(os.environ.get("MASTER_PORT", "29500"))}


def resolve_backend(backend: str, device_type: str) -> str:
    """``auto``: gloo on CPU; on GPUs NCCL for CUDA tensors *and* gloo for CPU ones.

    The trainer all-reduces a few small CPU tensors (loss, token counts, the stop flag);
    a pure NCCL group has no backend for them and would fail on the first step.
    """
    if backend != "auto":
        return backend
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def setup_parallel(rank: int, world_size: int, backend: str = "auto", master_addr: str = "127.0.0.1",
                   master_port: int | str = 29500, device_type: str = "auto", local_rank: Optional[int] = None) -> None:
    """Join (or create) the default process group; pin this process to its GPU."""
    device_type = default_device_type() if device_type == "auto" else device_type
    backend = resolve_backend(backend, device_type)
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count() if local_rank is None else local_rank)
    os.environ.setdefault("MASTER_ADDR", str(master_addr))
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if not is_distributed():
        # env:// also picks up torchrun's agent-hosted store instead of opening a second one
        dist.init_process_group(backend, rank=rank, world_size=world_size, init_method="env://")


# How long ``cleanup_parallel`` leaves the interpreter idle after tearing the group down.
BACKEND_SETTLE_SECONDS = 0.2


def cleanup_parallel() -> None:
    """Leave the process group: a last barrier, destroy it, then let its threads settle.

    The settling is what makes exiting safe. gloo's worker threads outlive
    ``destroy_process_group`` (something in DDP keeps the group alive in torch 2.13), and
    each finished collective is released by the worker that ran it, a moment after the
    caller has already been woken. Releasing it drops tensors that still have Python
    objects, which needs the GIL; if the interpreter has begun finalising by then, CPython
    ends that thread with a forced unwind through a ``noexcept`` destructor and the
    process aborts ("terminate called without an active exception") after all its work
    is done. Sleeping releases the GIL so the workers finish that release first.
    """
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(BACKEND_SETTLE_SECONDS)


def _spawned(rank: int, fn: Callable, world_size: int, backend: str, master_addr: str, master_port: int,
             device_type: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    setup_parallel(rank, world_size, backend, master_addr, master_port, device_type, local_rank=rank)
    try:
        fn(*args)
    finally:
        cleanup_parallel()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on just now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def spawn_parallel_fn(fn: Callable, nprocs: int, *args: Any, backend: str = "auto", master_addr: str = "127.0.0.1",
                      master_port: int = 0, device_type: str = "auto") -> None:
    """Run ``fn(*args)`` in ``nprocs`` local processes that form one process group.

    With ``nprocs == 1`` it simply calls ``fn`` here (no process group), so single-device
    code paths stay plain. ``master_port`` 0 takes a free port, so two local runs at once
    do not collide on a fixed one.
    """
    if nprocs == 1:
        fn(*args)
        return
    master_port = master_port or free_port(master_addr)
    mp.spawn(_spawned, args=(fn, nprocs, backend, master_addr, master_port, device_type, args), nprocs=nprocs,
             join=True)


def only_on_rank(rank: int = 0) -> Callable:
    """Decorator: run the function on one rank only (others get None) — for file writing."""

    def decorator(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any):
            return fn(*args, **kwargs) if get_rank() == rank else None

        return wrapper

    return decorator
