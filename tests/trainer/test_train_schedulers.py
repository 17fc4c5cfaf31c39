"""Schedulers follow their formulas at chosen steps."""

import math

import pytest
import torch

from astrai.trainer import SchedulerFactory


def lr_at(schedule, steps, base=1.0, **kwargs):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = SchedulerFactory.create(opt, schedule, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def cos(p, m):
    return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))


def test_cosine_warmup_then_cosine_to_min_rate():
    lrs = lr_at("cosine", 30, base=2.0, warmup_steps=4, lr_decay_steps=20, min_rate=0.1)
    assert lrs[0] == pytest.approx(2.0 * 1 / 4)
    assert lrs[3] == pytest.approx(2.0)
    assert lrs[4] == pytest.approx(2.0 * cos(0.0, 0.1))
    assert lrs[14] == pytest.approx(2.0 * cos(10 / 20, 0.1))
    assert lrs[24] == pytest.approx(2.0 * 0.1)
    assert lrs[29] == pytest.approx(2.0 * 0.1)


def test_sgdr_restarts_with_growing_cycles():
    lrs = lr_at("sgdr", 40, warmup_steps=2, cycle_length=4, t_mult=2, min_rate=0.0)
    assert lrs[2] == pytest.approx(1.0)
    assert lrs[4] == pytest.approx(cos(2 / 4, 0.0))
    assert lrs[6] == pytest.approx(1.0)           # restart after 4 steps
    assert lrs[10] == pytest.approx(cos(4 / 8, 0.0))
    assert lrs[14] == pytest.approx(1.0)          # second cycle lasted 8
    assert lrs[14 + 15] == pytest.approx(cos(15 / 16, 0.0))


def test_wsd_warmup_stable_linear_decay():
    lrs = lr_at("wsd", 20, warmup_steps=2, total_steps=20, decay_steps=5, min_rate=0.2)
    assert lrs[0] == pytest.approx(0.5)
    assert lrs[2] == lrs[14] == pytest.approx(1.0)
    assert lrs[15] == pytest.approx(1.0)
    assert lrs[17] == pytest.approx(1 - 0.8 * 2 / 5)
    assert lrs[19] == pytest.approx(1 - 0.8 * 4 / 5)


def test_scheduler_state_round_trips():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = SchedulerFactory.create(opt, "cosine", warmup_steps=3, lr_decay_steps=10)
    for _ in range(5):
        opt.step()
        sched.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = SchedulerFactory.create(opt2, "cosine", warmup_steps=3, lr_decay_steps=10)
    sched2.load_state_dict(sched.state_dict())
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]
