"""A task with a checkable answer, for GRPO and for measuring what a model learnt.

Arithmetic written the shortest way ("3+4=" → "7"), so a few-million-parameter model
can learn it in minutes on a CPU, and a rule, not a model, decides whether an answer is
right: ``check_answer`` is the reward.

Measuring needs problems the model never trained on, so the two-operand problems with
operands 0..99 (addition, and subtraction with a non-negative result) are split once,
by a fixed seed that no run changes, into a training pool and a disjoint held-out pool
(``task_pools``). Each problem may be asked three ways: ``23+45=``, ``What is 23+45?``
and ``23+45等于多少？``; the split is by problem, so no phrasing of a held-out problem
is ever trained on. The held-out pool avoids the single-digit additions the bundled
conversations teach, and every phrasing keeps the symbolic ``a+b`` the GRPO reward reads
back from the prompt.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_LEADING_INTEGER = re.compile(r"\s*(-?\d+)")

# The split of the pooled problems: fixed for good, so numbers from different runs compare.
POOL_SPLIT_SEED = 37
POOL_MAX_OPERAND = 99
POOL_OPS = "+-"
HELDOUT_SIZE = 450
STYLES = ("short", "en", "zh")
_PHRASINGS = {"short": "{a}{op}{b}=", "en": "What is {a}{op}{b}?", "zh": "{a}{op}{b}等于多少？"}


def _problem(a: int, op: str, b: int, style: str = "short") -> dict:
    prompt = _PHRASINGS[style].format(a=a, op=op, b=b)
    return {"prompt": prompt, "answer": str(OPERATORS[op](a, b)), "a": a, "b": b, "op": op, "style": style}


def make_problems(n: int, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[dict]:
    """``n`` problems ``{"prompt": "3+4=", "answer": "7", "a", "b", "op"}``, deterministic in ``seed``.

    Operands are drawn from 0..max_operand; for "-" the larger comes first, so every
    answer is a non-negative integer. These are drawn freely (the bundled single-digit
    data); for training and measuring on disjoint problems use ``task_pools``.
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
        problems.append({key: value for key, value in _problem(a, op, b).items() if key != "style"})
    return problems


def problem_key(problem: dict) -> tuple[int, str, int]:
    """What identifies a problem whatever its phrasing."""
    return problem["a"], problem["op"], problem["b"]


@lru_cache(maxsize=1)
def task_pools() -> tuple[tuple[tuple[int, str, int], ...], tuple[tuple[int, str, int], ...]]:
    """``(training, held_out)`` problem keys ``(a, op, b)``: every pooled problem is in
    exactly one. The held-out pool holds HELDOUT_SIZE problems with at least one
    two-digit operand, drawn by POOL_SPLIT_SEED."""
    keys = [(a, op, b) for op in POOL_OPS for a in range(POOL_MAX_OPERAND + 1) for b in range(POOL_MAX_OPERAND + 1)
            if op != "-" or a >= b]
    candidates = [k for k in keys if max(k[0], k[2]) >= 10]
    held = random.Random(POOL_SPLIT_SEED).sample(candidates, HELDOUT_SIZE)  # in drawn order: any prefix is a fair sample
    held_set = set(held)
    return tuple(k for k in keys if k not in held_set), tuple(held)


def heldout_problems(n: int | None = None) -> list[dict]:
    """The held-out pool (or its first ``n``), each problem in one fixed phrasing, the three
    phrasings taking turns: the same list in every run."""
    held = task_pools()[1][:n]
    return [_problem(a, op, b, STYLES[i % len(STYLES)]) for i, (a, op, b) in enumerate(held)]


def training_problems(n: int, seed: int = 0) -> list[dict]:
    """``n`` problems drawn (with replacement) from the training pool, each in a random
    phrasing, deterministic in ``seed``."""
    rng = random.Random(seed)
    pool = task_pools()[0]
    return [_problem(*rng.choice(pool), rng.choice(STYLES)) for _ in range(n)]


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


def preference_pair(problem: dict, rng: random.Random) -> dict:
    """A DPO record: chosen is the right answer, rejected an answer off by 1 to 10 (a
    near miss, the mistake a model that has the format but not the sum makes)."""
    right = int(problem["answer"])
    wrong = right + rng.choice([d for d in range(-10, 11) if d and right + d >= 0])
    return {"prompt": problem_messages(problem), "chosen": str(right), "rejected": str(wrong)}


def grpo_record(problem: dict) -> dict:
    """A GRPO prompt record (the reward reads the problem back from the prompt text)."""
    return {"prompt": problem_messages(problem), "problem": problem["prompt"], "answer": problem["answer"]}
