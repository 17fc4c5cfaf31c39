"""What each training stage changed against the stage before it, and a headline that says so.

A run's report reads as a story only when every stage is judged by what it added: a
fine-tuning stage measured against the base model takes credit for the stages before it.
So each evaluated stage is set against its predecessor: held-out bits per byte as a
relative change, task accuracy as a difference in points with a 95% interval. The
interval is Newcombe's (method 10) built from the two stages' Wilson intervals; it
treats the two accuracies as independent, which is conservative here, where both stages
answer the same problems.
"""

from __future__ import annotations

import math
from typing import Optional

from astrai.eval.intervals import mean_interval

STAGE_TITLES = {"pretrain": "pre-training", "sft": "SFT", "dpo": "DPO", "grpo": "GRPO"}
# Stages judged also by held-out preference accuracy, the metric their training optimises.
PREFERENCE_STAGES = ("dpo",)


def difference_interval(before: dict, after: dict) -> tuple[float, float]:
    """95% interval of ``after.accuracy - before.accuracy`` from each one's Wilson ``interval``."""
    p1, (l1, u1) = before["accuracy"], before["interval"]
    p2, (l2, u2) = after["accuracy"], after["interval"]
    d = p2 - p1
    return d - math.hypot(p2 - l2, u1 - p1), d + math.hypot(u2 - p2, p1 - l1)


def stage_change(before: dict, after: dict) -> dict:
    """What stage record ``after`` changed against stage record ``before`` (both carrying ``eval``)."""
    ev0, ev1 = before.get("eval", {}), after.get("eval", {})
    ppl0, ppl1 = ev0.get("perplexity", {}), ev1.get("perplexity", {})
    change: dict = {"stage": after["name"], "against": before["name"], "bits_per_byte": {
        name: {"before": ppl0[name]["bits_per_byte"], "after": ppl1[name]["bits_per_byte"],
               "relative": ppl1[name]["bits_per_byte"] / ppl0[name]["bits_per_byte"] - 1}
        for name in ppl1 if name in ppl0}}
    task0, task1 = ev0.get("task"), ev1.get("task")
    if task0 and task1:
        change["accuracy"] = accuracy_change(task0, task1)
        change["mean_reward"] = {"before": task0["mean_reward"], "after": task1["mean_reward"]}
    pref0, pref1 = ev0.get("preference"), ev1.get("preference")
    if pref0 and pref1:
        change["preference"] = {**accuracy_change(pref0, pref1), "margin": margin_change(pref0, pref1)}
    return change


def margin_change(before: dict, after: dict) -> dict:
    """The mean preference margin's change in nats; with both stages' per-pair margins on the same
    pairs, the paired difference's 95% interval."""
    change = {"before": before["mean_margin"], "after": after["mean_margin"],
              "nats": after["mean_margin"] - before["mean_margin"]}
    m0, m1 = before.get("margins"), after.get("margins")
    if m0 and m1 and len(m0) == len(m1) >= 2:
        low, high = mean_interval([b - a for a, b in zip(m0, m1)])
        change.update(interval=[low, high], significant=low > 0 or high < 0)
    return change


def accuracy_change(before: dict, after: dict) -> dict:
    """Two accuracies with Wilson intervals → the difference in points with its 95% interval."""
    low, high = difference_interval(before, after)
    return {"before": before["accuracy"], "after": after["accuracy"], "points": 100 * (after["accuracy"] - before["accuracy"]),
            "interval": [100 * low, 100 * high], "significant": low > 0 or high < 0}


def stage_changes(stages: list[dict]) -> list[dict]:
    """One change per evaluated stage after the first, each against the evaluated stage before it."""
    evaluated = [s for s in stages if s.get("eval")]
    return [stage_change(before, after) for before, after in zip(evaluated, evaluated[1:])]


def unigram_bits_per_byte(record: dict) -> Optional[float]:
    """The unigram baseline of a held-out file's perplexity record, in bits per byte."""
    if not record.get("unigram_perplexity") or not record.get("bytes"):
        return None
    return math.log2(record["unigram_perplexity"]) * record["tokens"] / record["bytes"]


def _what_was_trained(summary: dict) -> str:
    model = summary["model"]
    minutes = summary["total_seconds"] / 60
    if "preset" in model:
        depth = f" with {model['n_layers']} layers" if model.get("n_layers") else ""
        return (f"A `{model['preset']}` model{depth} ({model['parameters']:,} parameters) trained from scratch "
                f"in {minutes:.1f} min")
    return f"{model['base']} ({model['parameters']:,} parameters, {model['finetune']} fine-tuning) trained for {minutes:.1f} min"


def _points(a: dict) -> str:
    low, high = a["interval"]
    verdict = "" if a["significant"] else ", within noise"
    return (f"{a['before']:.3f} → {a['after']:.3f} ({a['points']:+.1f} points, "
            f"95% interval [{low:+.1f}, {high:+.1f}]{verdict})")


def _describe(change: dict) -> str:
    title = STAGE_TITLES.get(change["stage"], change["stage"])
    bits = [f"{name} {c['relative']:+.1%}" for name, c in change["bits_per_byte"].items()]
    parts = ["bits/byte " + ", ".join(bits)] if bits else []
    if "accuracy" in change:
        parts.append("task accuracy " + _points(change["accuracy"]))
    if "preference" in change and change["stage"] in PREFERENCE_STAGES:
        parts.append("held-out preference accuracy " + _points(change["preference"]))
        margin = change["preference"]["margin"]
        if "interval" in margin:
            verdict = "" if margin["significant"] else ", within noise"
            parts.append("mean preference margin {:.2f} → {:.2f} nats ({:+.2f}, 95% interval [{:+.2f}, {:+.2f}]{})".format(
                margin["before"], margin["after"], margin["nats"], *margin["interval"], verdict))
    return f"{title} against {STAGE_TITLES.get(change['against'], change['against'])}: " + "; ".join(parts) + "."


def headline(summary: dict) -> str:
    """A few sentences from the run's own figures: what was trained, how well its first stage
    models held-out text against the unigram baseline, and what each later stage changed."""
    stages = [s for s in summary["stages"] if s.get("eval")]
    if not stages:
        return _what_was_trained(summary) + "; no stage was evaluated."
    first = stages[0]
    texts = []
    for name, record in first["eval"].get("perplexity", {}).items():
        baseline = unigram_bits_per_byte(record)
        against = f" (unigram baseline {baseline:.3f})" if baseline is not None else ""
        texts.append(f"{name} {record['bits_per_byte']:.3f}{against}")
    sentence = _what_was_trained(summary)
    if texts:
        sentence += f": after {STAGE_TITLES.get(first['name'], first['name'])}, held-out bits/byte " + ", ".join(texts)
    task = first["eval"].get("task")
    if task:
        sentence += f"; held-out task accuracy {task['accuracy']:.3f}"
    return " ".join([sentence + ".", *(_describe(c) for c in summary.get("changes") or stage_changes(stages)),
                     *([_too_short(summary["task_shortfall"])] if summary.get("task_shortfall") else [])])


def _too_short(shortfall: dict) -> str:
    if "needed_steps" in shortfall:  # a run from a pretrained model: SFT's and GRPO's steps
        names = list(shortfall["steps"])
        ran = " and ".join(f"{STAGE_TITLES.get(n, n)} ran {shortfall['steps'][n]} steps" for n in names)
        needed = " and ".join(str(shortfall["needed_steps"][n]) for n in names)
        pace = " and ".join(f"{shortfall['step_seconds'][n]:.1f} s per {STAGE_TITLES.get(n, n)} step" for n in names)
        return (f"{ran}, short of the {needed} after which GRPO added 10 points: at this machine's {pace}, "
                f"`--minutes {shortfall['minutes']}` gives them.")
    return (f"Pre-training read {shortfall['task_tokens'] / 1e6:.2f}M tokens of worked problems, short of the "
            f"{shortfall['needed_tokens'] / 1e6:.1f}M the task needs: at this machine's "
            f"{shortfall['tokens_per_s']:,.0f} training tokens/s, `--minutes {shortfall['minutes']}` gives them.")
