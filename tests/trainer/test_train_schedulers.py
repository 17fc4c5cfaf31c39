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


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "sgdr", "constant"])
@pytest.mark.parametrize("first,then", [(200, 260), (200, 150)])
def test_a_resized_schedule_continues_as_one_built_for_the_new_length(schedule, first, then):
    """Stretched or shrunk after step 25, a schedule gives from there on the rates of one
    built for the new length from the start, and the optimizer's rate follows at once."""
    from astrai.config import TrainConfig
    from astrai.trainer.lr_schedules import resize_schedule, scheduler_kwargs

    config = TrainConfig(schedule=schedule, warmup_ratio=0.05, decay_ratio=0.5, min_rate=0.1, sgdr_cycle_ratio=0.2)

    def build(total):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return opt, SchedulerFactory.create(opt, schedule, **scheduler_kwargs(config, total))

    opt, sched = build(first)
    for _ in range(25):
        opt.step()
        sched.step()
    before = opt.param_groups[0]["lr"]
    resize_schedule(sched, config, then)
    ref_opt, ref = build(then)
    for _ in range(25):
        ref_opt.step()
        ref.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert sched.get_last_lr() == pytest.approx(ref.get_last_lr())
    rates, expected = [], []
    for _ in range(then - 25):
        opt.step(), ref_opt.step()
        sched.step(), ref.step()
        rates.append(opt.param_groups[0]["lr"])
        expected.append(ref_opt.param_groups[0]["lr"])
    assert rates == pytest.approx(expected)
    if schedule != "constant":  # the length changed what the run does
        plain_opt, plain = build(first)
        plain_rates = []
        for step in range(then):
            plain_opt.step()
            plain.step()
            if step >= 25:
                plain_rates.append(plain_opt.param_groups[0]["lr"])
        assert plain_rates != pytest.approx(rates)
    else:
        assert before == rates[-1] == 1.0
