"""Sizing the stages from the time budget, the deadline guard, and the command line."""

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import astrai.quickstart.from_scratch as quickstart
from astrai.cli import main
from astrai.config import TrainConfig
from astrai.errors import ConfigError
from astrai.quickstart.from_scratch import (ARITHMETIC_MAX_SHARE, ARITHMETIC_MIN_SHARE, ARITHMETIC_TOKENS, GRPO_WARMUP,
                                            PACE_CHECK_STEPS, PACE_STEP_SHARE, PACE_TOLERANCE, PRETRAIN_EMBEDDING_LR_SCALE,
                                            PRETRAIN_WEIGHT_DECAY,
                                            load_plan, plan_of, run_quickstart,
                                            PRETRAIN_STEP_SHARE, SFT_MAX_PASSES, SFT_MAX_REPLAY, SFT_REPLAY, STAGE_SHARES, Deadline,
                                            Quickstart, Settings, make_pace_check_callback, make_replan_callback,
                                            TASK_TOKENS_ENOUGH, arithmetic_share_for, make_stage_deadline_callback,
                                            SHALLOW_BELOW_TOKENS, SHALLOW_LAYERS, TRAIN_STAGES, minutes_for_the_task,
                                            planned_tokens, write_json)


def planner(tmp_path, minutes=15.0, spent=0.0, tokens_per_s=4000.0):
    qs = Quickstart(Settings(out=str(tmp_path), minutes=minutes))
    qs.deadline = Deadline(minutes, already_spent=spent)
    qs.tps = tokens_per_s
    qs.tokenizer = SimpleNamespace(vocab_size=4096)
    write_json(qs.done_path("data"), {kind: {"written": n, "tokens": 50 * n} for kind, n in
                                      (("pretrain", 2000), ("sft", 7000), ("dpo", 2800), ("grpo", 500))})
    return qs


def test_stage_shares_split_the_time_left(tmp_path):
    qs = planner(tmp_path, minutes=15.0, spent=60.0)
    qs.eval_seconds = 10.0
    left = qs.deadline.left
    pretrain = qs.stage_seconds("pretrain")
    assert pretrain == pytest.approx((left - 4 * 10.0 - 5.0) * STAGE_SHARES["pretrain"], rel=1e-3)
    grpo = qs.stage_seconds("grpo")  # the last stage gets all that is left after its evaluation
    assert grpo == pytest.approx(left - 10.0 - 5.0, rel=1e-3)
    assert sum(STAGE_SHARES.values()) == pytest.approx(1.0)


def test_timed_evaluations_are_all_reserved_and_an_estimate_at_most_30_percent(tmp_path):
    """SmolLM2's evaluations took 130-160 s each on a Zen 1: capped at 30% of the time left, the
    three after SFT were under-reserved and the run took 16.5 of 15 minutes."""
    qs = planner(tmp_path, minutes=15.0, spent=170.0)
    left = qs.deadline.left
    qs.eval_seconds = 146.0
    assert qs.training_seconds_left("sft") == pytest.approx(left - 3 * 146.0 - 5.0, rel=1e-3)
    qs.eval_seconds = None
    qs.estimate_eval_seconds = lambda: 146.0
    assert qs.training_seconds_left("sft") == pytest.approx(0.7 * left - 5.0, rel=1e-3)


def test_only_stages_with_a_successor_may_overrun_their_plan(tmp_path):
    qs = planner(tmp_path, minutes=15.0, spent=60.0)
    qs.eval_seconds = 10.0
    pretrain = qs.stage_seconds("pretrain")
    assert qs.stage_time_limit("pretrain", pretrain) == pytest.approx(1.15 * pretrain, rel=1e-3)
    grpo = qs.stage_seconds("grpo")  # the last one: its overrun would come out of the whole run's budget
    assert qs.stage_time_limit("grpo", grpo) == pytest.approx(grpo, rel=1e-3)
    too_long = qs.deadline.left + 100
    assert qs.stage_time_limit("grpo", too_long) == too_long  # never below the stage's own plan


def test_step_counts_follow_the_measured_throughput(tmp_path):
    qs = planner(tmp_path, tokens_per_s=4000.0)
    qs.s.steps = None
    config = qs.train_config(0, "pretrain", seconds=100.0)
    tokens_per_step = qs.s.batch_size * qs.s.window_size
    # pre-training plans a little under what the probed rate would fit (its checkpoints and
    # validation take the rest of its time)
    assert PRETRAIN_STEP_SHARE < 1
    assert config.max_steps == int(PRETRAIN_STEP_SHARE * 100.0 * 4000.0 / tokens_per_step)
    assert config.model_overrides["vocab_size"] == 4096 and config.train_type == "seq"
    faster = planner(tmp_path, tokens_per_s=8000.0).train_config(0, "pretrain", seconds=100.0)
    assert faster.max_steps == pytest.approx(2 * config.max_steps, abs=1)
    for index, name in enumerate(("sft", "dpo", "grpo"), start=1):
        stage = qs.train_config(index, name, seconds=60.0)
        assert stage.train_type == name and stage.max_steps >= 2
    assert qs.train_config(2, "dpo", seconds=1e6).max_steps == 2800 // (2 * qs.s.batch_size)  # half a pass at most
    # time for more: 1.5 passes over the conversations, which make up 1 - SFT_MAX_REPLAY of the batches
    sft = qs.train_config(1, "sft", seconds=1e6)
    assert sft.max_steps == int(SFT_MAX_PASSES * 50 * 7000 / (1 - SFT_MAX_REPLAY) / tokens_per_step)
    assert [d.get("type") for d in sft.datasets] == [None, "seq"]
    assert sft.datasets[1]["rate"] == pytest.approx(SFT_MAX_REPLAY, abs=1e-3)
    # time for less: at least SFT_REPLAY replayed, the conversations seen less than 1.5 times
    short = qs.train_config(1, "sft", seconds=10.0)
    assert short.max_steps == int(10.0 * 4000.0 / tokens_per_step) and short.datasets[1]["rate"] == SFT_REPLAY
    # between: the replayed text fills what the time buys past 1.5 passes
    between = qs.train_config(1, "sft", seconds=SFT_MAX_PASSES * 50 * 7000 / (1 - 0.65) / 4000.0)
    assert between.datasets[1]["rate"] == pytest.approx(0.65, abs=1e-3)
    fixed = planner(tmp_path / "fixed", tokens_per_s=4000.0)
    fixed.s.sft_replay = 0.3
    config = fixed.train_config(1, "sft", seconds=1e6)
    assert config.datasets[1]["rate"] == 0.3
    assert config.max_steps == int(SFT_MAX_PASSES * 50 * 7000 / 0.7 / tokens_per_step)
    plain = planner(tmp_path / "plain", tokens_per_s=4000.0)
    plain.s.sft_replay = 0.0
    assert plain.train_config(1, "sft", seconds=1e6).data_root_path.endswith("sft")
    grpo = qs.train_config(3, "grpo", 60.0)
    assert grpo.strategy_kwargs["reward"] == "arithmetic"
    # GRPO plans the steps its estimate fits in its share, not more: it runs at a constant rate,
    # and a plan the guard cuts short reads as an unfinished stage
    assert grpo.max_steps == int(60.0 / qs.grpo_step_seconds())


def test_a_resumed_stage_keeps_the_steps_and_mixture_it_started_with(tmp_path):
    """SFT's replay share follows the time its pace buys; a stage resumed where the pace reads
    otherwise must not change its mixture (or its schedule) halfway."""
    qs = planner(tmp_path, tokens_per_s=4000.0)
    seconds = 300.0  # at this pace each stage's mixture is between its floor and its cap
    for index, name in ((0, "pretrain"), (1, "sft")):
        started = qs.train_config(index, name, seconds)
        qs.stage_dir(name).mkdir(parents=True)
        started.save(qs.stage_dir(name) / "train_config.json")
        write_json(qs.stage_dir(name) / "budget.json", {"seconds": seconds})
    qs.tps = 16000.0  # the same stages planned now would be four times longer, their mixtures other
    for index, name in ((0, "pretrain"), (1, "sft")):
        started = json.loads((qs.stage_dir(name) / "train_config.json").read_text())
        assert qs.train_config(index, name, seconds).datasets[1]["rate"] != started["datasets"][1]["rate"]
        config, budget = qs.resumed_config(index, name)
        assert budget == seconds and config.max_steps == started["max_steps"]
        assert [d["rate"] for d in config.datasets] == [d["rate"] for d in started["datasets"]]


def test_pretraining_warms_up_then_decays_linearly_to_zero(tmp_path):
    import torch

    from astrai.trainer.lr_schedules import SchedulerFactory, scheduler_kwargs

    config = planner(tmp_path).train_config(0, "pretrain", seconds=100.0)
    config.data_root_path = config.tokenizer_path = config.datasets = None  # none made here: the schedule's fields are what is checked
    config.validate(require_data=False)
    steps = config.max_steps
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.max_lr)
    schedule = SchedulerFactory.create(optimizer, config.schedule, **scheduler_kwargs(config, steps))
    factors = [schedule.factor(step) for step in range(steps + 1)]
    warmup = round(0.05 * steps)
    assert factors[warmup] == pytest.approx(1.0) and factors[0] < factors[warmup // 2] < 1.0
    assert all(a > b for a, b in zip(factors[warmup:steps], factors[warmup + 1:steps + 1]))  # falls every step
    middle = (warmup + steps) // 2
    assert factors[middle] == pytest.approx(1 - (middle - warmup) / (steps - warmup), abs=0.01)  # a straight line
    assert factors[steps] == pytest.approx(0.0)  # to zero, not to a share of the peak
    # the embedding steps faster than the rest; fine-tuning keeps one rate
    assert config.embedding_lr_scale == PRETRAIN_EMBEDDING_LR_SCALE > 1
    sft = planner(tmp_path).train_config(1, "sft", seconds=100.0)
    assert sft.embedding_lr_scale == 1.0
    # pre-training decays the matrices and the table alike; fine-tuning keeps the defaults
    assert config.adamw_weight_decay == config.embedding_weight_decay == PRETRAIN_WEIGHT_DECAY > 0
    assert sft.embedding_weight_decay == 0.0 and sft.adamw_weight_decay == TrainConfig().adamw_weight_decay


def test_deadline_guard_ends_the_stage_like_a_reached_budget():
    guard = make_stage_deadline_callback(0.05)
    context = SimpleNamespace(step=3, total_steps=100, done=False)
    guard.on_train_begin(context)
    guard.on_step_end(context)
    assert context.total_steps == 100
    time.sleep(0.06)
    context.step = 4
    guard.on_step_end(context)
    assert context.total_steps == 4


def test_deadline_guard_stops_before_a_step_that_would_end_past_the_budget():
    clock = FakeClock()
    guard = make_stage_deadline_callback(100.0, clock=clock)
    context = SimpleNamespace(step=0, total_steps=50, done=False)
    guard.on_train_begin(context)
    clock.now, context.step = 30.0, 1  # the first step also loads and warms up: not a pace
    guard.on_step_end(context)
    for step, now in ((2, 40.0), (3, 50.0), (4, 60.0), (5, 70.0), (6, 80.0)):
        clock.now, context.step = now, step
        guard.on_step_end(context)
        assert context.total_steps == 50  # steps of 10 s still end inside the 100 s
    clock.now, context.step = 91.0, 7  # one more 10-second step would end at 101 s
    guard.on_step_end(context)
    assert context.total_steps == 7


def test_cli_refuses_a_non_positive_budget(capsys):
    assert main(["quickstart", "--minutes", "0", "--out", "unused"]) == 2
    assert "--minutes must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("share", [1.0, -0.1])
def test_replay_share_outside_0_1_is_refused_before_anything_runs(tmp_path, share):
    from astrai.errors import ConfigError
    from astrai.quickstart.from_scratch import run_quickstart

    with pytest.raises(ConfigError, match="sft_replay must be in"):
        run_quickstart(out=str(tmp_path / "run"), sft_replay=share)
    assert not (tmp_path / "run").exists()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pace_check_ends_the_stage_only_when_the_rate_is_off():
    first, last = PACE_CHECK_STEPS
    for seconds_per_step, stops in ((1.0, False), (1.0 / (1 + PACE_TOLERANCE + 0.05), True),
                                    (1.0 / (1 - PACE_TOLERANCE - 0.05), True)):
        clock = FakeClock()
        check = make_pace_check_callback(1000.0, 1000, clock=clock)  # expects one step a second
        context = SimpleNamespace(step=0, total_steps=500)
        while context.step < context.total_steps:
            context.step += 1
            clock.now += seconds_per_step
            check.on_step_end(context)
        assert (context.total_steps == last) == stops
        assert (check.measured == pytest.approx(1000.0 / seconds_per_step)) if stops else check.measured is None


class StandInTrainer:
    """Runs the callbacks over steps that cost nothing but fake-clock time, at ``rate`` tokens/s."""

    rate = 0.0
    clock = FakeClock()
    runs: list = []

    def __init__(self, config, callbacks=(), strategy_extra=None, backend_state=None):
        self.config, self.callbacks, self.backend_state = config, list(callbacks), backend_state

    def train(self, checkpoint=None):
        planned = self.config.max_steps
        context = SimpleNamespace(step=0, total_steps=planned, done=False, stop_requested=False,
                                  tokens_seen=0, backend_state=self.backend_state)
        context.resize = lambda total: setattr(context, "total_steps", total)
        for callback in self.callbacks:
            callback.on_train_begin(context)
        tokens_per_step = self.config.batch_per_device * self.config.window_size
        while context.step < context.total_steps:
            context.step += 1
            context.tokens_seen += tokens_per_step
            self.clock.now += tokens_per_step / self.rate
            for callback in self.callbacks:
                callback.on_step_end(context)
        Path(self.config.ckpt_dir).mkdir(parents=True, exist_ok=True)
        StandInTrainer.runs.append({"planned": planned, "ran": context.step,
                                    "callbacks": [type(c).__name__ for c in self.callbacks]})
        return context


def test_pace_check_within_tolerance_fits_the_stage_to_its_time_left():
    first, last = PACE_CHECK_STEPS
    for seconds_per_step in (0.9, 1.1):  # within the tolerance of the expected second a step
        clock = FakeClock()
        seen = []
        check = make_pace_check_callback(1000.0, 1000, seconds=300.0, clock=clock,
                                         on_replan=lambda *args: seen.append(args))
        context = SimpleNamespace(step=0, total_steps=270)
        context.resize = lambda total: setattr(context, "total_steps", total)
        while context.step < context.total_steps:
            context.step += 1
            clock.now += seconds_per_step
            check.on_step_end(context)
        fits = last + int(PACE_STEP_SHARE * (300.0 - last * seconds_per_step) / seconds_per_step)
        assert check.measured is None and context.step == fits != 270
        assert seen == [(last, 270, fits)]
        assert context.step * seconds_per_step == pytest.approx(PACE_STEP_SHARE * 300.0, rel=0.01)


def pace_driven(qs, monkeypatch, real_rate):
    """``qs``'s pre-training stage under the stand-in trainer at ``real_rate`` tokens/s."""
    qs.evaluate = lambda name: {}
    write_json(qs.out / "throughput.json", {"tokens_per_s": 4000.0})
    StandInTrainer.rate, StandInTrainer.runs = real_rate, []
    monkeypatch.setattr(quickstart, "Trainer", StandInTrainer)
    real_check = quickstart.make_pace_check_callback
    monkeypatch.setattr(quickstart, "make_pace_check_callback",
                        lambda *args, **kw: real_check(*args, **kw, clock=StandInTrainer.clock))
    return qs.train_stage(0, "pretrain"), StandInTrainer.runs


def test_pretraining_within_its_pace_tolerance_is_planned_again_in_place_and_the_plan_repeats_it(tmp_path, monkeypatch):
    qs = planner(tmp_path / "a", tokens_per_s=4000.0)
    qs.s.steps = None
    qs.s.model_overrides = {"n_layers": 4}  # the depth given, so the pace alone decides
    first_config = qs.train_config(0, "pretrain", qs.stage_seconds("pretrain"))
    record, runs = pace_driven(qs, monkeypatch, 4400.0)
    tokens_per_step = qs.s.batch_size * qs.s.window_size
    seconds = json.loads((qs.stage_dir("pretrain") / "budget.json").read_text())["seconds"]
    last = PACE_CHECK_STEPS[1]
    fits = last + int(PACE_STEP_SHARE * (seconds - last * tokens_per_step / 4400.0) * 4400.0 / tokens_per_step)
    assert len(runs) == 1 and "PaceCheck" in runs[0]["callbacks"] and qs.tps == 4000.0  # no start over
    assert runs[0] == {**runs[0], "planned": first_config.max_steps, "ran": fits}
    assert fits > first_config.max_steps * 1.05  # the probe's rate with PRETRAIN_STEP_SHARE left time unused
    assert record["planned_steps"] == record["steps"] == fits
    assert record["replanned"] == {"at_step": last, "first_steps": first_config.max_steps}
    saved = json.loads((qs.stage_dir("pretrain") / "train_config.json").read_text())
    assert saved["max_steps"] == fits  # a resumed run continues the second plan
    plan = plan_of([record], pinned=False)
    assert plan["replanned"] == {"pretrain": record["replanned"]} and plan["steps"] == {"pretrain": fits}

    # pinned by that plan, a run starts with the first length (and the mixture it sized) and
    # changes to the second at the same step, with no pace check of its own
    path = tmp_path / "plan.json"
    write_json(path, {**plan, "steps": {"pretrain": fits, "sft": 5, "dpo": 5, "grpo": 5}})
    pinned = planner(tmp_path / "b", tokens_per_s=4000.0)
    pinned.s.steps, pinned.s.stop_at, pinned.s.replanned = (load_plan(path)[k] for k in ("steps", "stop_at", "replanned"))
    share = pinned.train_config(0, "pretrain", 1.0).datasets[1]["rate"]
    assert share == first_config.datasets[1]["rate"] != arithmetic_share_for(fits * tokens_per_step)
    again, runs = pace_driven(pinned, monkeypatch, 9000.0)
    assert runs[0] == {**runs[0], "planned": first_config.max_steps, "ran": fits}
    assert "ResizeAtStep" in runs[0]["callbacks"] and "PaceCheck" not in runs[0]["callbacks"]
    assert plan_of([again], pinned=True)["replanned"] == plan["replanned"]


@pytest.mark.parametrize("real_rate", [8000.0, 3000.0])
def test_pretraining_starts_over_when_its_pace_differs_from_the_probe(tmp_path, monkeypatch, real_rate):
    qs = planner(tmp_path, tokens_per_s=4000.0)
    qs.s.steps = None
    # the depth given, so the pace alone decides (at 3,000 tokens/s the 4-layer model would read
    # too few tokens and the run would go shallow: tested on its own below)
    qs.s.model_overrides = {"n_layers": 4}
    record, runs = pace_driven(qs, monkeypatch, real_rate)
    assert len(runs) == 2
    assert runs[0]["ran"] == PACE_CHECK_STEPS[1] and "PaceCheck" in runs[0]["callbacks"]
    assert "PaceCheck" not in runs[1]["callbacks"]  # checked once: a second plan is never thrown away
    # planned again at the measured rate (the rate also changes the reserve for evaluations a little)
    seconds = json.loads((qs.stage_dir("pretrain") / "budget.json").read_text())["seconds"]
    assert runs[1]["planned"] == int(PRETRAIN_STEP_SHARE * seconds * real_rate / (qs.s.batch_size * qs.s.window_size))
    assert runs[1]["planned"] == pytest.approx(real_rate / 4000.0 * runs[0]["planned"], rel=0.05)
    assert record["steps"] == runs[1]["planned"] and qs.tps == pytest.approx(real_rate)
    saved = json.loads((qs.out / "throughput.json").read_text())
    assert saved == {"tokens_per_s": pytest.approx(real_rate), "probed_tokens_per_s": 4000.0}
    saved_plan = json.loads((qs.stage_dir("pretrain") / "train_config.json").read_text())
    assert saved_plan["max_steps"] == runs[1]["planned"]  # a resumed run continues the second plan


class _Context:
    def __init__(self, total_steps):
        self.step, self.total_steps = 0, total_steps

    @property
    def done(self):
        return self.step >= self.total_steps


def _run_replan(total_steps, seconds=20.0):
    """Steps of 2 s after a first one of 5 s (it starts the engine), the callback timing three."""
    now = [0.0]
    replan = make_replan_callback(seconds, timed_steps=3, clock=lambda: now[0])
    context = _Context(total_steps)
    replan.on_train_begin(context)
    for step, ends_at in enumerate((5.0, 7.0, 9.0, 11.0), start=1):
        now[0], context.step = ends_at, step
        replan.on_step_end(context)
    return replan, context


def test_grpo_plans_again_from_its_own_timed_steps():
    # at step 4, 11 s in, steps take 2 s: four more fit in the 9 s left
    replan, context = _run_replan(total_steps=50)
    assert context.total_steps == replan.planned == 8
    replan, context = _run_replan(total_steps=6)  # fewer than fit: the plan stands
    assert context.total_steps == 6 and replan.planned is None


def test_grpo_checks_its_pace_again_as_steps_slow_down():
    """Steps of 2 s while timed, 3 s afterwards (longer answers): the later checks shorten the
    plan again, and the stage ends within its time having run every step it planned."""
    now = [0.0]
    replan = make_replan_callback(40.0, timed_steps=3, clock=lambda: now[0])
    context = _Context(100)
    replan.on_train_begin(context)
    while not context.done:
        context.step += 1
        now[0] = 5.0 if context.step == 1 else now[0] + (2.0 if context.step <= 4 else 3.0)
        replan.on_step_end(context)
    assert now[0] <= 40.0 and context.step == context.total_steps == replan.planned < 18  # 18: the first plan


def test_grpo_plans_back_the_steps_that_slow_early_steps_cut():
    """Steps of 4 s while timed (another job's load), 2 s afterwards: the first check cuts the
    plan, the later ones give the steps back, never past the first plan, and the stage ends
    within its time with under two steps of it unused."""
    for first_plan, seconds in ((100, 60.0), (20, 200.0)):
        now = [0.0]
        replan = make_replan_callback(seconds, timed_steps=3, clock=lambda: now[0])
        context = _Context(first_plan)
        replan.on_train_begin(context)
        plans = []
        while not context.done:
            context.step += 1
            now[0] = 5.0 if context.step == 1 else now[0] + (4.0 if context.step <= 4 else 2.0)
            replan.on_step_end(context)
            plans.append(context.total_steps)
        assert now[0] <= seconds and context.step == context.total_steps <= first_plan
        if first_plan == 100:
            assert min(plans) < context.step  # cut, then grown back
            assert seconds - now[0] < 2.0 * 2  # the time left at the end: under two steps
        else:
            assert context.step == first_plan  # time to spare: the first plan stands


def test_pretraining_sees_the_same_worked_problems_on_a_slow_and_a_fast_machine():
    assert 0 < ARITHMETIC_MIN_SHARE < ARITHMETIC_MAX_SHARE < 1
    for tokens in (2_000_000, 4_000_000, 7_000_000, 14_000_000):  # an AVX2 machine's 15 minutes to a Zen 5's
        assert arithmetic_share_for(tokens) * tokens == pytest.approx(ARITHMETIC_TOKENS, rel=1e-6)
    assert arithmetic_share_for(100 * ARITHMETIC_TOKENS) == ARITHMETIC_MIN_SHARE  # a long run: the floor
    assert arithmetic_share_for(ARITHMETIC_TOKENS // 10) == ARITHMETIC_MAX_SHARE  # a very slow one: the cap


def test_a_budget_too_short_for_the_task_says_so_and_names_the_minutes_that_would_do(tmp_path, capsys):
    """On a Zen 1 (1,732 training tokens/s) 15 minutes bought 0.63M tokens of worked problems and
    the task was not learnt: the run says so before pre-training and in the report, with the
    budget that would buy ARITHMETIC_TOKENS of them."""
    assert minutes_for_the_task(15, TASK_TOKENS_ENOUGH) is None
    assert minutes_for_the_task(15, 629_145) == 40  # 15 x 1.5M / 0.63M = 35.8, in whole five minutes
    assert minutes_for_the_task(30, 1_100_000) == 45
    slow, fast = planner(tmp_path / "slow", tokens_per_s=1732.0), planner(tmp_path / "fast", tokens_per_s=16000.0)
    for qs in (slow, fast):
        config = qs.train_config(0, "pretrain", seconds=qs.stage_seconds("pretrain"))
        tokens = planned_tokens(config)
        assert qs.task_share(config) == config.datasets[1]["rate"] > 0
        qs.warn_if_too_short(tokens * qs.task_share(config))
        said = capsys.readouterr().err
        if qs is slow:
            minutes = minutes_for_the_task(15, tokens * qs.task_share(config))
            assert minutes >= 30 and f"--minutes {minutes} gives them" in said and "expect low task accuracy" in said
        else:
            assert said == ""
    shortfall = slow.task_shortfall({"task_tokens": 629_145, "tokens_per_s": 1741.0})
    assert shortfall == {"task_tokens": 629_145, "needed_tokens": ARITHMETIC_TOKENS, "minutes": 40, "tokens_per_s": 1741.0}
    assert slow.task_shortfall({"task_tokens": 1_300_000}) is None
    assert slow.task_shortfall({}) is None  # pre-training without worked problems


def test_pretraining_mixes_the_worked_problems_in_by_share_and_the_later_stages_keep_their_guards(tmp_path):
    qs = planner(tmp_path)
    for seconds in (100.0, 700.0, 2000.0, 5000.0):  # the share follows the stage's planned tokens
        config = qs.train_config(0, "pretrain", seconds=seconds)
        share = arithmetic_share_for(planned_tokens(config))
        assert [(Path(d["path"]).name, d["rate"], d["type"]) for d in config.datasets] == \
            [("pretrain", 1 - share, "seq"), ("arithmetic", share, "seq")]
        assert config.data_root_path is None
    assert qs.train_config(0, "pretrain", seconds=100.0).datasets[1]["rate"] == ARITHMETIC_MAX_SHARE
    assert qs.train_config(0, "pretrain", seconds=2000.0).datasets[1]["rate"] < 0.25  # 7M tokens: 1.5M of them
    assert qs.train_config(0, "pretrain", seconds=5000.0).datasets[1]["rate"] == ARITHMETIC_MIN_SHARE
    pinned = planner(tmp_path / "pinned")
    pinned.s.steps = {"pretrain": 1000}  # a pinned plan's steps decide the share, not the clock
    assert pinned.train_config(0, "pretrain", seconds=1.0).datasets[1]["rate"] == \
        pytest.approx(arithmetic_share_for(1000 * pinned.s.batch_size * pinned.s.window_size))
    fixed = planner(tmp_path / "fixed")
    fixed.s.arithmetic_share = 0.25  # a share set by hand is taken as it is
    assert fixed.train_config(0, "pretrain", seconds=100.0).datasets[1]["rate"] == 0.25
    fixed.s.arithmetic_chat_share = 0.4  # of them, this share in the chat template, a dataset beside the lines
    config = fixed.train_config(0, "pretrain", seconds=100.0)
    assert [(Path(d["path"]).name, d["rate"]) for d in config.datasets] == \
        [("pretrain", 0.75), ("arithmetic", pytest.approx(0.15)), ("arithmetic_chat", pytest.approx(0.1))]
    assert fixed.task_share(config) == pytest.approx(0.25)
    fixed.s.arithmetic_chat_share = 1.0  # all of them
    assert [Path(d["path"]).name for d in fixed.train_config(0, "pretrain", seconds=100.0).datasets] == \
        ["pretrain", "arithmetic_chat"]
    assert qs.train_config(2, "dpo", seconds=100.0).strategy_kwargs["rpo_alpha"] == qs.s.dpo_rpo_alpha > 0
    grpo = qs.train_config(3, "grpo", seconds=100.0)
    assert grpo.warmup_ratio == GRPO_WARMUP > 0 and grpo.strategy_kwargs["max_new_tokens"] >= 24
    # without worked problems (or at a share of 0) pre-training reads the text alone
    plain = planner(tmp_path / "plain")
    plain.s.arithmetic_share = 0.0
    config = plain.train_config(0, "pretrain", seconds=100.0)
    assert config.datasets is None and Path(config.data_root_path).name == "pretrain"
    with pytest.raises(ConfigError, match="arithmetic_share must be in"):
        run_quickstart(out=str(tmp_path / "run"), arithmetic_share=1.0)
    with pytest.raises(ConfigError, match=r"arithmetic_chat_share must be in \[0, 1\], got 1.5"):
        run_quickstart(out=str(tmp_path / "run"), arithmetic_chat_share=1.5)


def test_a_cpu_too_slow_for_the_four_layer_model_trains_it_with_two(tmp_path, capsys):
    """On a Zen 1 the 4-layer `tiny` read 0.63M worked-problem tokens in 15 minutes and learnt
    nothing; with SHALLOW_LAYERS layers it reads more in the same minutes. A Zen 3's pace keeps 4
    layers (2 layers once lost the task in SFT there). The choice is measured again (the
    throughput) and kept in settings.json and plan.json; a faster CPU, another preset, a depth
    given by the user or a pinned plan keep theirs."""
    slow = planner(tmp_path / "slow", tokens_per_s=1732.0)
    probes = []
    slow.probe_throughput = lambda precision: probes.append(slow.model_overrides()) or 2944.0
    config = slow.train_config(0, "pretrain", seconds=slow.stage_seconds("pretrain"))
    assert slow.goes_shallow(config)
    assert slow.s.n_layers == SHALLOW_LAYERS and slow.tps == 2944.0 and probes[0]["n_layers"] == SHALLOW_LAYERS
    err = capsys.readouterr().err
    assert "training it with 2 layers" in err and "measuring the 2-layer model's training throughput" in err
    assert json.loads((tmp_path / "slow" / "settings.json").read_text())["n_layers"] == SHALLOW_LAYERS
    shallow = slow.train_config(0, "pretrain", seconds=slow.stage_seconds("pretrain"))
    assert shallow.model_overrides["n_layers"] == SHALLOW_LAYERS and shallow.max_steps > config.max_steps
    assert not slow.goes_shallow(shallow)  # chosen once
    # the shallow model's own threshold: 1.07M worked-problem tokens taught it the task
    assert slow.task_shortfall({"task_tokens": 1_070_000}) is None
    assert slow.task_shortfall({"task_tokens": 900_000})["minutes"] == 25
    assert planner(tmp_path / "deep", tokens_per_s=1732.0).task_shortfall({"task_tokens": 1_070_000}) is not None
    # the plan keeps the depth and a rerun from it takes it
    plan = tmp_path / "plan.json"
    write_json(plan, plan_of([{"name": n, "steps": 3, "planned_steps": 3} for n in TRAIN_STAGES], pinned=False,
                             n_layers=slow.s.n_layers))
    assert load_plan(plan)["n_layers"] == SHALLOW_LAYERS
    write_json(plan, {**json.loads(plan.read_text()), "n_layers": 0})
    with pytest.raises(ConfigError, match="'n_layers' must be a positive integer"):
        load_plan(plan)
    # just under the threshold goes shallow; a Zen 3's pace (1.9M tokens with 4 layers) does not
    under = planner(tmp_path / "under", tokens_per_s=3000.0)
    under.measure_throughput = lambda: 5000.0
    under_config = under.train_config(0, "pretrain", seconds=under.stage_seconds("pretrain"))
    assert 1_000_000 < planned_tokens(under_config) < SHALLOW_BELOW_TOKENS
    assert under.goes_shallow(under_config) and under.s.n_layers == SHALLOW_LAYERS
    for rate in (4000.0, 16000.0):
        fast = planner(tmp_path / f"fast{rate:.0f}", tokens_per_s=rate)
        fast_config = fast.train_config(0, "pretrain", seconds=fast.stage_seconds("pretrain"))
        assert planned_tokens(fast_config) >= SHALLOW_BELOW_TOKENS
        assert not fast.goes_shallow(fast_config) and fast.s.n_layers is None
    # the slow CPU's 4-layer plan again: each of these keeps its depth all the same
    for name, change in (("small", dict(preset="small")), ("given", dict(model_overrides={"n_layers": 4})),
                         ("pinned", dict(steps={n: 3 for n in TRAIN_STAGES}))):
        kept = planner(tmp_path / name, tokens_per_s=1732.0)
        kept.s.__dict__.update(change)
        assert not kept.goes_shallow(config) and kept.s.n_layers is None
