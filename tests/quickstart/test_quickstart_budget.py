"""Sizing the stages from the time budget, the deadline guard, and the command line."""

import time
from types import SimpleNamespace

import pytest

from astrai.cli import main
from astrai.quickstart import PRETRAIN_STEP_SHARE, SFT_MAX_PASSES, STAGE_SHARES, Deadline, Quickstart, Settings, make_stage_deadline_callback, write_json


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
    assert qs.train_config(1, "sft", seconds=1e6).max_steps == int(SFT_MAX_PASSES * 50 * 7000 / tokens_per_step)
    assert qs.train_config(3, "grpo", 60.0).strategy_kwargs["reward"] == "arithmetic"


def test_deadline_guard_ends_the_stage_like_a_reached_budget():
    guard = make_stage_deadline_callback(0.05)
    context = SimpleNamespace(step=3, total_steps=100, done=False)
    guard.on_train_begin(context)
    guard.on_step_end(context)
    assert context.total_steps == 100
    time.sleep(0.06)
    guard.on_step_end(context)
    assert context.total_steps == 3


def test_cli_refuses_a_non_positive_budget(capsys):
    assert main(["quickstart", "--minutes", "0", "--out", "unused"]) == 2
    assert "--minutes must be positive" in capsys.readouterr().err
