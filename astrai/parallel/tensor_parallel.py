"""Megatron-style tensor-parallel linears.

ColumnParallelLinear splits the output features across ranks; RowParallelLinear
splits the input features and sums the partial products. Put back to back
(column → row) they need one all-reduce forward and one backward per pair. The three
small autograd functions below are the only places ranks talk to each other.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; backward sums the input gradient of every rank's shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce (sum) forward; the gradient of a sum reaches every rank unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """Concatenate the ranks' last-dim shards forward; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(world, dim=-1)[rank].contiguous(), None


class ParallelModel(nn.Module):
    """A module whose parameters are split over the ranks of ``process_group``."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        self.process_group = process_group or dist.group.WORLD
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)

    def _shard(self, size: int, name: str) -> int:
        if size % self.world_size:
            raise ValueError(f"{name} ({size}) must be divisible by the tensor-parallel world size ({self.world_size})")
        return size // self.world_size

    def _parameters_of_shape(self, out_features: int, in_features: int, bias: bool) -> None:
        """This rank's weight [out, in] (normal, std 0.02) and, when asked, a zero bias [out]."""
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)


class ColumnParallelLinear(ParallelModel):
    """y = x Wᵀ with W's rows (output features) split; ``gather_output`` concatenates the shards."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None):
        super().__init__(process_group)
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self._parameters_of_shape(self._shard(out_features, "out_features"), in_features, bias)

    def load_dense(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "ColumnParallelLinear":
        """Take this rank's slice of a full [out, in] weight."""
        with torch.no_grad():
            self.weight.copy_(weight.chunk(self.world_size, dim=0)[self.rank])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias.chunk(self.world_size, dim=0)[self.rank])
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            x = _CopyToParallel.apply(x, self.process_group)
        y = F.linear(x, self.weight, self.bias)
        if not self.gather_output or self.world_size == 1:
            return y
        return _GatherFromParallel.apply(y, self.process_group)


class RowParallelLinear(ParallelModel):
    """y = Σ_r x_r W_rᵀ with W's columns (input features) split; the sum is an all-reduce.

    ``input_is_parallel`` means x already holds only this rank's slice (as produced by a
    ColumnParallelLinear with ``gather_output=False``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, input_is_parallel: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None):
        super().__init__(process_group)
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        self._parameters_of_shape(out_features, self._shard(in_features, "in_features"), bias)

    def load_dense(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "RowParallelLinear":
        with torch.no_grad():
            self.weight.copy_(weight.chunk(self.world_size, dim=1)[self.rank])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.chunk(self.world_size, dim=-1)[self.rank]
        y = F.linear(x, self.weight)
        if self.world_size > 1:
            y = _ReduceFromParallel.apply(y, self.process_group)
        return y if self.bias is None else y + self.bias
