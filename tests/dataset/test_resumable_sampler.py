"""The sampler: ranks partition each epoch, epochs differ, and resuming repeats nothing."""

import pytest
import torch
from torch.utils.data import DataLoader

from astrai.dataset import ResumableDistributedSampler
from astrai.errors import ConfigError


@pytest.mark.parametrize("length,world", [(103, 4), (64, 2), (7, 3), (10, 1)])
def test_ranks_partition_a_permutation(length, world):
    shards = [list(ResumableDistributedSampler(length, rank=r, world_size=world, seed=3)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    union = [i for s in shards for i in s]
    per_rank = -(-length // world)
    assert sorted(set(union)) == list(range(length))
    assert len(union) - length == per_rank * world - length  # only wrap-around padding repeats
    dropped = [list(ResumableDistributedSampler(length, rank=r, world_size=world, seed=3, drop_last=True))
               for r in range(world)]
    flat = [i for s in dropped for i in s]
    assert len(flat) == len(set(flat)) == (length // world) * world


def test_order_depends_only_on_seed_and_epoch():
    first = ResumableDistributedSampler(50, seed=1, rank=0, world_size=1)
    epoch0, epoch1 = list(first), list(first)  # a full pass moves on to the next epoch
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1) == list(range(50))
    again = ResumableDistributedSampler(50, seed=1, rank=0, world_size=1)
    assert list(again) == epoch0
    again.set_epoch(1)
    assert list(again) == epoch1
    assert list(ResumableDistributedSampler(50, seed=2, rank=0, world_size=1)) != epoch0
    assert list(ResumableDistributedSampler(50, shuffle=False, rank=0, world_size=1)) == list(range(50))


@pytest.mark.parametrize("stop_after", [0, 1, 5, 12])
def test_resume_mid_epoch_yields_the_identical_remaining_batches(stop_after):
    dataset = torch.arange(100)

    def run(sampler, batches):
        loader = DataLoader(dataset, batch_size=4, sampler=sampler)
        out = []
        for epoch in range(sampler.epoch, 2):
            sampler.set_epoch(epoch)
            for batch in loader:
                out.append(batch.tolist())
                if len(out) == batches:
                    return out
        return out

    reference = run(ResumableDistributedSampler(dataset, rank=1, world_size=2, seed=7, batch_size=4), None)
    interrupted = ResumableDistributedSampler(dataset, rank=1, world_size=2, seed=7, batch_size=4)
    before = run(interrupted, stop_after) if stop_after else []
    state = interrupted.state_dict()
    resumed = ResumableDistributedSampler(dataset, rank=1, world_size=2, seed=0, batch_size=4)
    resumed.load_state_dict(state)
    assert len(resumed) == 50 - 4 * stop_after  # 50 indices per rank, 4 per batch
    assert before + run(resumed, None) == reference
    assert ResumableDistributedSampler(dataset, rank=1, world_size=2, seed=7, batch_size=4,
                                       start_epoch=state["epoch"], start_iter=state["iteration"]).state_dict() == state


def test_bad_rank_is_a_config_error():
    with pytest.raises(ConfigError, match="rank 2"):
        ResumableDistributedSampler(10, rank=2, world_size=2)
