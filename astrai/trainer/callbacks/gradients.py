"""Gradient checkpointing and clipping callbacks."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from astrai.trainer.callbacks.base import CallbackFactory, TrainCallback


@CallbackFactory.register("gradient_checkpointing")
class GradientCheckpointingCallback(TrainCallback):
    """Recompute the activations of the named module types in backward instead of storing them.

    Wraps each matching module's ``forward`` with non-reentrant checkpointing (works
    with torch.compile and through DDP, found with ``nn.Module.apply``).
    """

    def __init__(self, modules: Sequence[str | type] = ("DecoderBlock",)):
        self.modules = tuple(modules)
        self.wrapped = 0

    def _matches(self, module: torch.nn.Module) -> bool:
        return any(type(module).__name__ == m if isinstance(m, str) else isinstance(module, m) for m in self.modules)

    def _wrap(self, module: torch.nn.Module) -> None:
        if not self._matches(module) or getattr(module, "_astrai_checkpointed", False):
            return
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if module.training and torch.is_grad_enabled():
                return checkpoint(inner, *args, use_reentrant=False, **kwargs)
            return inner(*args, **kwargs)

        module.forward = forward
        module._astrai_checkpointed = True
        self.wrapped += 1

    def on_train_begin(self, context) -> None:
        if self.modules:
            context.model.apply(self._wrap)


@CallbackFactory.register("gradient_clipping")
class GradientClippingCallback(TrainCallback):
    """Clip the global gradient norm to ``max_grad_norm`` (0 = only measure it) and record it."""

    def __init__(self, max_grad_norm: float = 1.0):
        self.max_grad_norm = max_grad_norm

    def on_optimizer_step(self, context) -> None:
        params = [p for p in context.model.parameters() if p.grad is not None]
        if not params:
            context.grad_norm = 0.0
            return
        limit = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        context.grad_norm = float(norm)
