"""Accuracy on a task whose answers a program can check (the bundled arithmetic).

The problems come with a checker that turns an answer text into a reward in [0, 1];
a problem counts as solved when its reward is 1. Mean reward is reported too, since
partial credit (e.g. a right number in a wrong format) shows progress earlier. The
accuracy comes with its 95% Wilson interval, and with one accuracy per phrasing when
the problems say how they were asked (``style``).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

from astrai.dataset.arithmetic import check_answer, heldout_problems
from astrai.eval.generation import Generator, chat_prompt
from astrai.eval.intervals import wilson_interval

# Mean-reward credit for an answer that is an integer, but the wrong one: a model that has
# learnt the answer format but not yet the sums shows it in the mean reward.
FORMAT_CREDIT = 0.1


def task_accuracy(generator: Generator, tokenizer, problems: Sequence, prompt_of: Callable[[object], str],
                  check: Callable[[object, str], float], chat: bool = True, n_examples: int = 5) -> dict:
    """Generate an answer per problem and score it with ``check(problem, answer)``."""
    prompts = [chat_prompt(tokenizer, prompt_of(p)) if chat else prompt_of(p) for p in problems]
    answers = generator(prompts)
    rewards = [float(check(p, a)) for p, a in zip(problems, answers)]
    solved = sum(r >= 1.0 for r in rewards)
    by_style: dict = {}
    for problem, reward in zip(problems, rewards):
        if isinstance(problem, dict) and "style" in problem:
            by_style.setdefault(problem["style"], []).append(reward >= 1.0)
    return {
        "accuracy": solved / len(rewards),
        "interval": list(wilson_interval(solved, len(rewards))),
        "mean_reward": sum(rewards) / len(rewards),
        "n": len(rewards),
        **({"by_style": {style: {"accuracy": sum(hits) / len(hits), "n": len(hits)} for style, hits in by_style.items()}}
           if by_style else {}),
        "examples": [{"prompt": prompt_of(p), "answer": a, "reward": r}
                     for p, a, r in list(zip(problems, answers, rewards))[:n_examples]],
    }


def arithmetic_task(n: int | None = None, plain_text: bool = False) -> tuple[list[dict], Callable, Callable]:
    """The arithmetic task's held-out pool (or its first ``n`` problems) as
    ``(problems, prompt_of, check)`` for ``evaluate``: problems no run trains on, the same
    in every run (``astrai.dataset.arithmetic.heldout_problems``). A wrong integer earns
    FORMAT_CREDIT towards the mean reward, never towards the accuracy. ``plain_text``: for a
    model that continues text rather than answering a chat turn, the answer is the rest of
    the prompt's line (what follows belongs to the next line it invents)."""
    check = partial(check_answer, format_reward=FORMAT_CREDIT)
    if plain_text:
        check = partial(_first_line, check)
    return heldout_problems(n), (lambda p: p["prompt"]), check


def _first_line(check: Callable[[object, str], float], problem, text: str) -> float:
    return check(problem, text.split("\n", 1)[0])
