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


def test_preference_accuracy_changes_like_task_accuracy_and_dpo_reports_it():
    from astrai.eval.changes import headline

    def pref(preferred, n, margins):
        return {**task(preferred, n), "mean_margin": sum(margins) / len(margins), "margins": margins}

    before = [1.0, 2.0, 3.0, 4.0] * 25
    after = [m + shift for m, shift in zip(before, [0.5, 1.5] * 50)]  # every pair's margin up by 1 on average
    stages = [{"name": "sft", "eval": {"task": task(40, 90), "preference": pref(200, 450, before)}},
              {"name": "dpo", "eval": {"task": task(41, 90), "preference": pref(300, 450, after)}}]
    (dpo,) = stage_changes(stages)
    assert dpo["preference"]["points"] == pytest.approx(100 * 100 / 450) and dpo["preference"]["significant"]
    margin = dpo["preference"]["margin"]
    assert (margin["before"], margin["after"], margin["nats"]) == pytest.approx((2.5, 3.5, 1.0))
    # paired: the differences are 0.5 and 1.5, sd 0.5025 over 100 pairs -> 1 ± 1.96 * 0.05025
    assert margin["interval"] == pytest.approx([1 - 0.0985, 1 + 0.0985], abs=1e-3) and margin["significant"]
    summary = {"stages": stages, "model": {"preset": "tiny", "parameters": 10}, "total_seconds": 60}
    story = headline(summary)
    assert "held-out preference accuracy 0.444 → 0.667 (+22.2 points" in story
    assert "mean preference margin 2.50 → 3.50 nats (+1.00, 95% interval [+0.90, +1.10])" in story


def test_the_headline_says_when_pre_training_read_too_few_worked_problems():
    from astrai.eval.changes import headline

    stages = [{"name": "pretrain", "eval": {"task": task(20, 100)}}, {"name": "sft", "eval": {"task": task(1, 100)}}]
    summary = {"stages": stages, "model": {"preset": "tiny", "parameters": 10}, "total_seconds": 900}
    assert "worked problems" not in headline(summary)
    summary["task_shortfall"] = {"task_tokens": 629_145, "needed_tokens": 1_500_000, "minutes": 40, "tokens_per_s": 1741.0}
    assert headline(summary).endswith("Pre-training read 0.63M tokens of worked problems, short of the 1.5M the task "
                                      "needs: at this machine's 1,741 training tokens/s, `--minutes 40` gives them.")


def test_the_headline_says_when_a_run_from_a_pretrained_model_ran_too_few_steps():
    from astrai.eval.changes import headline

    stages = [{"name": "base", "eval": {"task": task(1, 100)}}, {"name": "sft", "eval": {"task": task(7, 100)}}]
    summary = {"stages": stages, "model": {"base": "smollm2", "parameters": 10, "finetune": "full"}, "total_seconds": 900,
               "task_shortfall": {"steps": {"sft": 17, "grpo": 15}, "needed_steps": {"sft": 140, "grpo": 50},
                                  "step_seconds": {"sft": 8.6, "grpo": 20.0}, "minutes": 50}}
    assert headline(summary).endswith("SFT ran 17 steps and GRPO ran 15 steps, short of the 140 and 50 after which "
                                      "GRPO added 10 points: at this machine's 8.6 s per SFT step and 20.0 s per "
                                      "GRPO step, `--minutes 50` gives them.")


def test_the_headline_names_the_depth_a_slow_cpu_chose():
    from astrai.eval.changes import headline

    stages = [{"name": "pretrain", "eval": {"task": task(20, 100)}}]
    summary = {"stages": stages, "model": {"preset": "tiny", "parameters": 2_622_720}, "total_seconds": 900}
    assert headline(summary).startswith("A `tiny` model (2,622,720 parameters) trained from scratch in 15.0 min")
    summary["model"]["n_layers"] = 2
    assert headline(summary).startswith("A `tiny` model with 2 layers (2,622,720 parameters) trained from scratch")
