"""The checkable arithmetic task: deterministic problems, a rule-based reward, and a
held-out pool that no training data reaches."""

import json
import random
import re

from astrai.alignment.rewards import arithmetic_reward
import pytest

from astrai.dataset.arithmetic import (HELDOUT_SIZE, STYLES, _problem, check_answer, grpo_record, heldout_problems,
                                       make_problems, preference_pair, problem_key, sft_conversation, task_pools,
                                       training_problems, worked_conversation, worked_line, worked_preference_pair,
                                       worked_solution)


def test_problems_are_deterministic_small_and_correct():
    problems = make_problems(200, seed=5, ops="+-*")
    assert problems == make_problems(200, seed=5, ops="+-*") != make_problems(200, seed=6, ops="+-*")
    for p in problems:
        assert 0 <= p["a"] <= 9 and 0 <= p["b"] <= 9 and p["prompt"] == f"{p['a']}{p['op']}{p['b']}="
        assert int(p["answer"]) == eval(p["prompt"][:-1]) >= 0
    assert {p["op"] for p in make_problems(50, seed=0)} == {"+"}


def test_reward_is_one_only_when_the_last_integer_stated_is_the_answer():
    problem = {"prompt": "3+4=", "answer": "7"}
    for right in ("7", " 7\n", "7.", "7。", "3+4=7, so 7", "3+4=7，所以7", "8? no: 7"):
        assert check_answer(problem, right) == 1.0, right
    for wrong in ("8", "77", "7 apples, 2 pears", "seven", "", "-7", "3+4=7, so 8", "7+1"):
        assert check_answer(problem, wrong) == 0.0, wrong
    assert check_answer(problem, "8", format_reward=0.1) == check_answer(problem, "7 or 9", 0.1) == 0.1
    assert check_answer(problem, "x", format_reward=0.1) == 0.0


def test_bundled_task_files_match_the_generator(bundled_data):
    lines = (bundled_data / "grpo" / "arithmetic.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 500
    for record in records:
        assert check_answer({"answer": record["answer"]}, record["answer"]) == 1.0
        assert record["prompt"] == [{"role": "user", "content": record["problem"]}]
        assert int(record["answer"]) == eval(record["problem"][:-1])
    conversation = sft_conversation(make_problems(1, seed=0)[0])["messages"]
    assert [m["role"] for m in conversation] == ["user", "assistant"]


def test_pools_split_every_problem_once_and_the_split_never_moves():
    train, held = task_pools()
    assert len(held) == HELDOUT_SIZE >= 300 and not set(train) & set(held)
    assert len(set(train)) + len(held) == 100 * 100 + 100 * 101 // 2  # every a+b and every a-b with a >= b
    assert all(max(a, b) >= 10 for a, _, b in held) and {op for _, op, _ in held} == {"+", "-"}
    # the held-out list is fixed: the same problems, phrasings and order in every process
    assert [p["prompt"] for p in heldout_problems(4)] == ["51-2=", "What is 63-34?", "16+0等于多少？", "23-1="]
    # no held-out problem is a step of some working: a borrow's units step (1x-y, y > x) is taught by every
    # working that borrows, so none is held out
    steps = {(10 + x, "-", y) for x in range(10) for y in range(x + 1, 10)}
    assert not steps & set(held) and (14, "-", 7) in train
    assert heldout_problems(5) == heldout_problems()[:5]
    assert {p["style"] for p in heldout_problems()} == set(STYLES)


def test_training_data_never_asks_a_held_out_problem(bundled_data):
    held = {problem_key(p) for p in heldout_problems()}
    drawn = training_problems(20_000, seed=0)
    assert not {problem_key(p) for p in drawn} & held
    assert {p["style"] for p in drawn} == set(STYLES) and training_problems(50, seed=3) == training_problems(50, seed=3)
    # nor do the bundled conversations, preference pairs and GRPO prompts (single-digit sums)
    bundled = []
    for name in ("sft/train.jsonl", "sft/valid.jsonl", "dpo/train.jsonl", "grpo/arithmetic.jsonl"):
        bundled += (bundled_data / name).read_text(encoding="utf-8").splitlines()
    asked = {(int(a), op, int(b)) for line in bundled for a, op, b in re.findall(r"(\d+)\s*([+\-])\s*(\d+)", line)}
    asked |= {(int(a), "+", int(b)) for line in bundled for a, b in re.findall(r"(\d+)\s*(?:plus|加)\s*(\d+)", line)}
    assert asked and not asked & held


def test_every_phrasing_is_rewarded_by_the_grpo_checker():
    rng = random.Random(0)
    for problem in heldout_problems(9) + training_problems(30, seed=1):
        record = grpo_record(problem)
        assert arithmetic_reward(record["prompt"][0]["content"], problem["answer"]) == 1.0
        assert check_answer(problem, problem["answer"]) == 1.0
        pair = preference_pair(problem, rng)
        assert pair["chosen"] == problem["answer"] != pair["rejected"] and int(pair["rejected"]) >= 0


STEP = re.compile(r"^(\d+)([+\-])(\d+)(?:([+\-])1)?=(\d+)$")


def _steps(working: str) -> tuple[list[tuple[int, str, int, int, int]], int]:
    """The working's steps (x, op, y, carried 1 or 0, result) and its conclusion."""
    english = " so " in working
    body, conclusion = working.split(", so " if english else "，所以")
    steps = []
    for step in body.split(", " if english else "，"):
        x, op, y, carried, z = STEP.match(step).groups()
        steps.append((int(x), op, int(y), 1 if carried else 0, int(z)))
    return steps, int(conclusion)


@pytest.mark.parametrize("op", "+-")
def test_the_working_of_every_pooled_problem_is_column_arithmetic_that_ends_in_the_answer(op):
    train, held = task_pools()
    for a, o, b in (k for k in train + held if k[1] == op):
        for style in ("en", "zh"):
            problem = _problem(a, o, b, style)
            working = worked_solution(problem)
            steps, conclusion = _steps(working)
            assert conclusion == int(problem["answer"]) and check_answer(problem, working) == 1.0
            # every step a true one-digit fact; units first, the carry or borrow carried into the tens
            x, _, y, _, units = steps[0]
            assert units == (x + y if op == "+" else x - y) and x % 10 == a % 10 and y == b % 10
            borrowed = op == "-" and x >= 10
            assert (x >= 10) == borrowed and (not borrowed or a % 10 < b % 10)
            if max(a, b) >= 10 if op == "+" else a >= 10:
                assert len(steps) == 2
                x, _, y, carried, tens = steps[1]
                assert (x, y) == (a // 10, b // 10)
                assert carried == (units >= 10 if op == "+" else borrowed)
                assert tens == (x + y + carried if op == "+" else x - y - carried)
            else:
                assert len(steps) == 1
    assert worked_solution(_problem(27, "+", 45, "short")) == "7+5=12, 2+4+1=7, so 72"
    assert worked_solution(_problem(72, "-", 45, "zh")) == "12-5=7，7-4-1=2，所以27"


def test_the_slipped_working_is_a_near_miss_that_follows_from_its_slip():
    train, held = task_pools()
    for a, op, b in train + held:
        problem = _problem(a, op, b, "en")
        slipped = worked_solution(problem, slip=True)
        steps, conclusion = _steps(slipped)
        assert check_answer(problem, slipped) == 0.0 and conclusion >= 0
        assert abs(conclusion - int(problem["answer"])) in (1, 10)  # a units step off by one, or a carry dropped
    assert worked_solution(_problem(27, "+", 45, "en"), slip=True) == "7+5=12, 2+4=6, so 62"
    with pytest.raises(ValueError, match="no column working"):
        worked_solution(_problem(3, "-", 5, "en"))


def test_worked_records_ask_the_problem_and_answer_with_its_working():
    problem = _problem(23, "+", 45, "en")
    assert worked_line(problem) == "What is 23+45? 3+5=8, 2+4=6, so 68"
    assert worked_conversation(problem)["messages"] == [{"role": "user", "content": "What is 23+45?"},
                                                       {"role": "assistant", "content": "3+5=8, 2+4=6, so 68"}]
    pair = worked_preference_pair(problem)
    assert pair["prompt"] == [{"role": "user", "content": "What is 23+45?"}]
    assert pair["chosen"] == "3+5=8, 2+4=6, so 68" and pair["rejected"] == "3+5=7, 2+4=6, so 67"
