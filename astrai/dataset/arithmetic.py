"""A task with a checkable answer, for GRPO and for measuring what a tiny model learnt.

Small-number arithmetic written the shortest way ("3+4=" → "7"), so a
few-million-parameter model can learn it in minutes on a CPU, and a rule, not a
model, decides whether an answer is right: ``check_answer`` is the reward.
"""

from __future__ import annotations

import random
import re

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_LEADING_INTEGER = re.compile(r"\s*(-?\d+)")


def make_problems(n: int, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[dict]:
    """``n`` problems ``{"prompt": "3+4=", "answer": "7", "a", "b", "op"}``, deterministic in ``seed``.

    Operands are drawn from 0..max_operand; for "-" the larger comes first, so every
    answer is a non-negative integer.
    """
    unknown = set(ops) - set(OPERATORS)
    if unknown:
        raise ValueError(f"unknown operators {sorted(unknown)}; choose from {sorted(OPERATORS)}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        op = rng.choice(ops)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        problems.append({"prompt": f"{a}{op}{b}=", "answer": str(OPERATORS[op](a, b)), "a": a, "b": b, "op": op})
    return problems


def extract_answer(text: str) -> str | None:
    """The integer a response starts with (after optional whitespace), or None."""
    match = _LEADING_INTEGER.match(text)
    return match.group(1) if match else None


def check_answer(problem: dict, text: str, format_reward: float = 0.0) -> float:
    """Reward of ``text`` as an answer to ``problem``.

    1.0 when the response is exactly the right integer (surrounding whitespace and a
    final "." or "。" allowed), ``format_reward`` when it starts with a wrong or
    trailing-garbage integer, else 0.0.
    """
    answer = extract_answer(text)
    if answer is None:
        return 0.0
    rest = text.strip()[len(answer):].strip()
    if answer == problem["answer"] and rest in ("", ".", "。"):
        return 1.0
    return float(format_reward)


def problem_messages(problem: dict) -> list[dict]:
    """The problem as a one-turn chat prompt (for chat-formatted GRPO rollouts)."""
    return [{"role": "user", "content": problem["prompt"]}]


def sft_conversation(problem: dict) -> dict:
    """An SFT record teaching the answer format: user "3+4=" → assistant "7"."""
    return {"messages": problem_messages(problem) + [{"role": "assistant", "content": problem["answer"]}]}
