"""ResumableDistributedSampler: a shuffled, rank-sharded order that can resume mid-epoch.

The order of an epoch depends only on (seed, epoch), every rank takes every
``world_size``-th index of it (padded by wrapping so ranks get equal counts, or
truncated with ``drop_last``), and the sampler remembers how far it got, so a run
restored from a checkpoint sees exactly the batches the interrupted run would
have seen next.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from astrai.errors import ConfigError


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ResumableDistributedSampler(Sampler[int]):
    """Indices of ``data_source`` (a dataset or a length) for one rank.

    ``iteration`` counts batches of ``batch_size`` already consumed in ``epoch``;
    the sampler advances it as it yields (exact with ``num_workers=0``; with
    prefetching workers save the trainer's own step count through
    ``load_state_dict``). After a full pass it moves to the next epoch itself.
    """

    def __init__(self, data_source: Sized | int, rank: int | None = None, world_size: int | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, start_epoch: int = 0,
                 start_iter: int = 0, batch_size: int = 1):
        default_rank, default_world = _default_rank_world()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not within world_size {self.world_size}")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        self.dataset_length = data_source if isinstance(data_source, int) else len(data_source)
        self.seed, self.shuffle, self.drop_last, self.batch_size = seed, shuffle, drop_last, batch_size
        self.start_epoch, self.start_iter = start_epoch, start_iter
        self.epoch, self.iteration = start_epoch, start_iter

    @property
    def num_samples(self) -> int:
        """Indices this rank gets per epoch."""
        if self.drop_last:
            return self.dataset_length // self.world_size
        return -(-self.dataset_length // self.world_size)

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's full index list for ``epoch`` (a pure function of seed, epoch, rank)."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.dataset_length, generator=generator).tolist()
        else:
            order = list(range(self.dataset_length))
        total = self.num_samples * self.world_size
        if total > len(order) and order:
            order = (order * (total // len(order) + 1))[:total]
        return order[:total][self.rank::self.world_size]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is the epoch being resumed."""
        if epoch != self.epoch:
            self.epoch, self.iteration = epoch, 0

    def __iter__(self) -> Iterator[int]:
        indices = self.epoch_indices(self.epoch)
        start = self.iteration * self.batch_size
        for position in range(start, len(indices)):
            if (position + 1) % self.batch_size == 0:
                self.iteration += 1  # the batch counts as consumed once its last index is handed out
            yield indices[position]
        self.epoch, self.iteration = self.epoch + 1, 0

    def __len__(self) -> int:
        return max(0, self.num_samples - self.iteration * self.batch_size)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "iteration": self.iteration, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.iteration = int(state["epoch"]), int(state["iteration"])
        self.seed = int(state.get("seed", self.seed))
