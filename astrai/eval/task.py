"""Accuracy on a task whose answers a program can check (the bundled arithmetic).

The problems come with a checker that turns an answer text into a reward in [0, 1];
a problem counts as solved when its reward is 1. Mean reward is reported too, since
partial credit (e.g. a right number in a wrong format) shows progress earlier.
"""

from __future__ import annotations

from typing import Callable, Sequence

from astrai.eval.generation import Generator, chat_prompt


def task_accuracy(generator: Generator, tokenizer, problems: Sequence, prompt_of: Callable[[object], str],
                  check: Callable[[object, str], float], chat: bool = True, n_examples: int = 5) -> dict:
    """Generate an answer per problem and score it with ``check(problem, answer)``."""
    prompts = [chat_prompt(tokenizer, prompt_of(p)) if chat else prompt_of(p) for p in problems]
    answers = generator(prompts)
    rewards = [float(check(p, a)) for p, a in zip(problems, answers)]
    return {
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "mean_reward": sum(rewards) / len(rewards),
        "n": len(rewards),
        "examples": [{"prompt": prompt_of(p), "answer": a, "reward": r}
                     for p, a, r in list(zip(problems, answers, rewards))[:n_examples]],
    }


def arithmetic_task(n: int, seed: int = 1234, **problem_kwargs) -> tuple[list[dict], Callable, Callable]:
    """The bundled arithmetic task as ``(problems, prompt_of, check)`` for ``evaluate``;
    ``problem_kwargs`` go to ``make_problems`` (``max_operand``, ``ops``). The default
    seed differs from the training seeds so evaluation problems are drawn separately."""
    from astrai.dataset.arithmetic import check_answer, make_problems

    return make_problems(n, seed=seed, **problem_kwargs), (lambda p: p["prompt"]), check_answer
