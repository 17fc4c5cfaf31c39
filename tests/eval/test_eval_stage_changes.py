"""A stage's change in task accuracy against the stage before it carries Newcombe's interval."""

import pytest

from astrai.eval.changes import difference_interval, stage_changes
from astrai.eval.intervals import wilson_interval


def task(solved, n):
    return {"accuracy": solved / n, "interval": list(wilson_interval(solved, n)), "mean_reward": solved / n}


def test_difference_interval_matches_newcombes_worked_example():
    # Newcombe (1998), Statistics in Medicine 17:873, table II example (56/70 vs 48/80): method 10
    # gives 0.0524 to 0.3339 for 56/70 - 48/80
    low, high = difference_interval(task(48, 80), task(56, 70))
    assert (low, high) == pytest.approx((0.0524, 0.3339), abs=5e-4)


def test_each_stage_is_set_against_the_one_before_it():
    ppl = lambda bpb: {"en": {"bits_per_byte": bpb}}  # noqa: E731
    stages = [{"name": "pretrain", "eval": {"perplexity": ppl(2.0), "task": task(0, 90)}},
              {"name": "sft", "eval": {"perplexity": ppl(2.02), "task": task(30, 90)}},
              {"name": "dpo", "eval": {"perplexity": ppl(2.02), "task": task(31, 90)}}]
    sft, dpo = stage_changes(stages)
    assert (sft["against"], dpo["against"]) == ("pretrain", "sft")
    assert sft["bits_per_byte"]["en"]["relative"] == pytest.approx(0.01)
    assert sft["accuracy"]["points"] == pytest.approx(100 / 3) and sft["accuracy"]["significant"]
    assert dpo["accuracy"]["points"] == pytest.approx(100 / 90) and not dpo["accuracy"]["significant"]
