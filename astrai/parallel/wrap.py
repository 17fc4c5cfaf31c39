"""Data-parallel wrapping (DDP or FSDP2) and the matching state-dict access."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from astrai.parallel.setup import get_world_size


def wrap_model(model: nn.Module, mode: str, device: torch.device, shard_modules: tuple[type, ...] = ()) -> nn.Module:
    """DDP wrapper, or FSDP2 ``fully_shard`` applied per block then to the root (in place)."""
    if get_world_size() == 1:
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if shard_modules and isinstance(module, shard_modules):
                fully_shard(module)
        fully_shard(model)
        return model
    raise ValueError(f"unknown parallel mode {mode!r}")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under a DDP/compile wrapper (FSDP2 shards in place, nothing to unwrap)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap_model(model), FSDPModule)


def no_sync(model: nn.Module, skip: bool) -> contextlib.AbstractContextManager:
    """Suppress the gradient all-reduce for all but the last micro-batch of a window."""
    if not skip:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if is_fsdp(model):
        return _fsdp_no_sync(unwrap_model(model))
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: Any):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on CPU, the same on every rank's call (collective under FSDP)."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in unwrap_model(model).state_dict().items()}


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        return
    unwrap_model(model).load_state_dict(state)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    optimizer.load_state_dict(state)
