"""A task with a checkable answer, for GRPO and for measuring what a model learnt.

Two-operand sums and differences, answered as a column sum worked units first
("27+45=" → "7+5=12, 2+4+1=7, so 72"): every step is a one-digit fact and the carry is
written down, so a few-million-parameter model learns to add held-out pairs in minutes
on a CPU, where the bare answer (the tens digit first, its carry unseen) takes it several
times the tokens. A rule, not a model, decides whether an answer is right: the last
integer it states (``check_answer``), which is also the reward.

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
_INTEGER = re.compile(r"-?\d+")

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


def _is_borrow_step(key: tuple[int, str, int]) -> bool:
    """Whether ``a-b`` is the units step of a working that borrows: 1x-y with y > x."""
    a, op, b = key
    return op == "-" and 10 <= a <= 18 and b <= 9 and a % 10 < b


@lru_cache(maxsize=1)
def task_pools() -> tuple[tuple[tuple[int, str, int], ...], tuple[tuple[int, str, int], ...]]:
    """``(training, held_out)`` problem keys ``(a, op, b)``: every pooled problem is in
    exactly one. The held-out pool holds HELDOUT_SIZE problems with at least one
    two-digit operand, drawn by POOL_SPLIT_SEED."""
    keys = [(a, op, b) for op in POOL_OPS for a in range(POOL_MAX_OPERAND + 1) for b in range(POOL_MAX_OPERAND + 1)
            if op != "-" or a >= b]
    candidates = [k for k in keys if max(k[0], k[2]) >= 10]
    # in drawn order, so any prefix is a fair sample; a problem that is itself a step of the column
    # working (a borrow, "14-7=7") is replaced in place by a spare draw, since every working that
    # borrows would otherwise teach its answer
    drawn = random.Random(POOL_SPLIT_SEED).sample(candidates, HELDOUT_SIZE + 20)
    spares = iter(k for k in drawn[HELDOUT_SIZE:] if not _is_borrow_step(k))
    held = [next(spares) if _is_borrow_step(k) else k for k in drawn[:HELDOUT_SIZE]]
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


def final_integer(text: str) -> str | None:
    """The last integer a response states, or None."""
    found = _INTEGER.findall(text)
    return found[-1] if found else None


def check_answer(problem: dict, text: str, format_reward: float = 0.0) -> float:
    """Reward of ``text`` as an answer to ``problem``: 1.0 when the last integer it states
    is the answer (so "68", "68." and "3+5=8, 2+4=6, so 68" all count),
    ``format_reward`` when it is another integer, 0.0 when it states none."""
    answer = final_integer(text)
    if answer is None:
        return 0.0
    return 1.0 if answer == problem["answer"] else float(format_reward)


def _off_by_one(units: int, seed: int) -> int:
    """+1 or -1 for a slipped units step, never across a multiple of ten (so no carry appears
    or vanishes with it): up from a 0, down from a 9, else as ``seed``'s parity says."""
    if units % 10 == 0:
        return 1
    if units % 10 == 9:
        return -1
    return 1 if seed % 2 else -1


def worked_solution(problem: dict, slip: bool = False) -> str:
    """The column working of ``problem``, units first, in the language of its phrasing:
    "3+5=8, 2+4=6, so 68"; "7+5=12, 2+4+1=7, so 72" (the carried 1 written out);
    "12-5=7, 7-4-1=2, so 27" (a borrow: 10 added to the units, 1 taken from the tens).
    A one-digit pair is a single step ("3+4=7, so 7").

    ``slip=True`` gives the working of a near miss, the mistakes column arithmetic
    invites: the carry or borrow forgotten when there is one, else the units step off by
    one, with the rest of the working following from it (for DPO's rejected answers)."""
    a, op, b = problem["a"], problem["op"], problem["b"]
    if op not in "+-" or not (0 <= a <= 99 and 0 <= b <= 99) or (op == "-" and b > a):
        raise ValueError(f"no column working for {a}{op}{b}: two operands 0..99, + or - with a >= b")
    a1, a0, b1, b0 = a // 10, a % 10, b // 10, b % 10
    two_columns = a1 > 0 or b1 > 0
    if op == "+":
        units = a0 + b0
        carry = units >= 10 and not (slip and two_columns)
        if slip and not (units >= 10 and two_columns):
            units += _off_by_one(units, a + b)
        steps = [f"{a0}+{b0}={units}"]
        tens = a1 + b1 + carry
        if two_columns:
            steps.append(f"{a1}+{b1}" + ("+1" if carry else "") + f"={tens}")
        result = tens * 10 + units % 10 if two_columns else units
    else:
        borrow = a0 < b0
        units = a0 + 10 * borrow - b0
        if slip and not (borrow and a1):
            units += _off_by_one(units, a + b)
        steps = [f"{'1' if borrow else ''}{a0}-{b0}={units}"]
        result = units
        if a1:
            tens = a1 - b1 - (borrow and not slip)
            steps.append(f"{a1}-{b1}" + ("-1" if borrow and not slip else "") + f"={tens}")
            result = tens * 10 + units
    separator, conclusion = ("，", "，所以") if problem.get("style") == "zh" else (", ", ", so ")
    return separator.join(steps) + conclusion + str(result)


def problem_messages(problem: dict) -> list[dict]:
    """The problem as a one-turn chat prompt (for chat-formatted GRPO rollouts)."""
    return [{"role": "user", "content": problem["prompt"]}]


def sft_conversation(problem: dict) -> dict:
    """An SFT record teaching the answer format: user "3+4=" → assistant "7"."""
    return {"messages": problem_messages(problem) + [{"role": "assistant", "content": problem["answer"]}]}


def worked_line(problem: dict) -> str:
    """A worked problem as a line of plain text: "What is 23+45? 3+5=8, 2+4=6, so 68"."""
    return f"{problem['prompt']} {worked_solution(problem)}"


def worked_conversation(problem: dict) -> dict:
    """An SFT record: the problem asked, the column working answered."""
    return {"messages": problem_messages(problem) + [{"role": "assistant", "content": worked_solution(problem)}]}


def worked_preference_pair(problem: dict) -> dict:
    """A DPO record: the working chosen over the near miss's working (``worked_solution``'s slip)."""
    return {"prompt": problem_messages(problem), "chosen": worked_solution(problem),
            "rejected": worked_solution(problem, slip=True)}


def preference_pair(problem: dict, rng: random.Random) -> dict:
    """A DPO record: chosen is the right answer, rejected an answer off by 1 to 10 (a
    near miss, the mistake a model that has the format but not the sum makes)."""
    right = int(problem["answer"])
    wrong = right + rng.choice([d for d in range(-10, 11) if d and right + d >= 0])
    return {"prompt": problem_messages(problem), "chosen": str(right), "rejected": str(wrong)}


def grpo_record(problem: dict) -> dict:
    """A GRPO prompt record (the reward reads the problem back from the prompt text)."""
    return {"prompt": problem_messages(problem), "problem": problem["prompt"], "answer": problem["answer"]}
