"""Megatron-style tensor-parallel linears.

ColumnParallelLinear splits the output features across ranks; RowParallelLinear
splits the input features and sums the partial products. Put back to back
(column → row) they need a single all-reduce per pair. Communication goes through
``torch.distributed.nn.functional`` so gradients flow through it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn import functional as F


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


class ColumnParallelLinear(ParallelModel):
    """y = x Wᵀ with W's rows (output features) split; ``gather_output`` concatenates the shards."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None):
        super().__init__(process_group)
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        local = self._shard(out_features, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def load_dense(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "ColumnParallelLinear":
        """Take this rank's slice of a full [out, in] weight."""
        with torch.no_grad():
            self.weight.copy_(weight.chunk(self.world_size, dim=0)[self.rank])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias.chunk(self.world_size, dim=0)[self.rank])
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.gather_output or self.world_size == 1:
            return y
        return torch.cat(dist_fn.all_gather(y, group=self.process_group), dim=-1)


class RowParallelLinear(ParallelModel):
    """y = Σ_r x_r W_rᵀ with W's columns (input features) split; the sum is an all-reduce.

    ``input_is_parallel`` means x already holds only this rank's slice (as produced by a
    ColumnParallelLinear with ``gather_output=False``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, input_is_parallel: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None):
        super().__init__(process_group)
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        local = self._shard(in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

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
            y = dist_fn.all_reduce(y, group=self.process_group)
        return y if self.bias is None else y + self.bias
