"""The checkable arithmetic task: deterministic problems and a rule-based reward."""

import json

from astrai.dataset.arithmetic import check_answer, make_problems, sft_conversation


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
