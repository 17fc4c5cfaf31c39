"""MixtureSampler: seeded, resumable, rank-sharded sample order over one or more datasets.

The order of epoch ``e`` depends only on (seed, e), so a resumed run replays exactly
the samples the interrupted one would have seen. With several datasets (a mixture,
spec 003) each draw first picks a source with probability proportional to its rate,
then the next index of that source's own shuffled order (cycling when exhausted).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch.utils.data import Sampler


class MixtureSampler(Sampler[int]):
    """Indices into the concatenation of ``sizes`` (dataset lengths), this rank's share only."""

    def __init__(self, sizes: Sequence[int], rates: Sequence[float] | None = None, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        self.sizes = [int(s) for s in sizes]
        self.rates = [float(r) for r in (rates or [1.0] * len(self.sizes))]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select epoch ``epoch`` and skip its first ``start`` indices (of this rank)."""
        self.epoch, self.start = int(epoch), int(start)

    def _global_order(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        if len(self.sizes) == 1:
            n = self.sizes[0]
            return torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        total = sum(self.sizes)
        sources = torch.multinomial(torch.tensor(self.rates, dtype=torch.float64), total, replacement=True, generator=gen)
        out = torch.empty(total, dtype=torch.long)
        for k, (size, offset) in enumerate(zip(self.sizes, self.offsets)):
            picks = (sources == k).nonzero().flatten()
            if len(picks) == 0:
                continue
            rounds = -(-len(picks) // size)
            order = torch.cat([torch.randperm(size, generator=gen) if self.shuffle else torch.arange(size)
                               for _ in range(rounds)])
            out[picks] = order[: len(picks)] + offset
        return out

    def __len__(self) -> int:
        return sum(self.sizes) // self.world_size

    def __iter__(self) -> Iterator[int]:
        order = self._global_order()
        mine = order[self.rank: len(self) * self.world_size: self.world_size]
        return iter(mine[self.start:].tolist())
