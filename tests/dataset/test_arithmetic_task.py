"""The checkable arithmetic task: deterministic problems, a rule-based reward, and a
held-out pool that no training data reaches."""

import json
import random

from astrai.alignment.rewards import arithmetic_reward
from astrai.dataset.arithmetic import (HELDOUT_SIZE, STYLES, check_answer, grpo_record, heldout_problems,
                                       make_problems, preference_pair, problem_key, sft_conversation, task_pools,
                                       training_problems)


def test_problems_are_deterministic_small_and_correct():
    problems = make_problems(200, seed=5, ops="+-*")
    assert problems == make_problems(200, seed=5, ops="+-*") != make_problems(200, seed=6, ops="+-*")
    for p in problems:
        assert 0 <= p["a"] <= 9 and 0 <= p["b"] <= 9 and p["prompt"] == f"{p['a']}{p['op']}{p['b']}="
        assert int(p["answer"]) == eval(p["prompt"][:-1]) >= 0
    assert {p["op"] for p in make_problems(50, seed=0)} == {"+"}


def test_reward_is_one_only_for_the_exact_answer():
    problem = {"prompt": "3+4=", "answer": "7"}
    assert check_answer(problem, "7") == 1.0
    assert check_answer(problem, " 7\n") == check_answer(problem, "7.") == check_answer(problem, "7。") == 1.0
    for wrong in ("8", "77", "7 apples", "seven", "", "-7"):
        assert check_answer(problem, wrong) == 0.0
    assert check_answer(problem, "8", format_reward=0.1) == 0.1
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
    assert [p["prompt"] for p in heldout_problems(4)] == ["51-2=", "What is 14-7?", "16+0等于多少？", "23-1="]
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
    import re

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
