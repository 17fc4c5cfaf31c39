"""The same seed and the same stage plan give the same numbers; the plan a run writes
pins the next one; a bad plan file is refused before anything runs."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from astrai.cli import main
from astrai.errors import ConfigError
from astrai.quickstart.from_scratch import (ARITHMETIC_MAX_SHARE, PLAN_FILE, Settings, load_plan, plan_of, resumed_settings,
                                          run_quickstart)

SMALL = dict(
    minutes=5, vocab_size=300, window_size=64, batch_size=4, eval_problems=24, ppl_max_tokens=300,
    sample_max_new_tokens=4, sft_arithmetic=300, dpo_arithmetic=40, grpo_problems=40, grpo_prompts_per_step=2,
    grpo_group_size=2, model_overrides=dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, dim_ffn=64, max_len=128),
    progress=False, corpus="bundled", pretrain_arithmetic=500,
)
PLAN = {"pretrain": 6, "sft": 4, "dpo": 2, "grpo": 2}
STOP_AT = {"pretrain": 4}
REPLANNED = {"pretrain": {"at_step": 2, "first_steps": 5}}  # started as 5 steps, made 6 at step 2


def numbers(summary: dict) -> list:
    """Every evaluation number and answer of every stage (timings left out)."""
    return [{key: value for key, value in stage["eval"].items() if key != "seconds"} | {"loss": stage["final_loss"]}
            for stage in summary["stages"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run's promise: where a GPU is visible the run trains there, "
                    "whose atomic adds (an embedding's gradient) sum in no fixed order, and its plan pins no CPU matmuls")
def test_same_seed_and_plan_give_identical_numbers(tmp_path, monkeypatch):
    """Pre-training starts as 5 steps, is made 6 at step 2 (as its pace check does) and stops
    at step 4 (as when the deadline guard ends a stage): the plan keeps all three, and the rerun
    does the same. The first run
    measures oneDNN's fp32 matmuls to be faster, the second would measure the BLAS's (a
    busier machine): the plan pins the first's, whose rounding the numbers depend on."""
    from astrai.backends.cpu import training

    measured = {"forward": True, "weight_grad": False}
    monkeypatch.setattr(training, "measured_choice", lambda: dict(measured))
    first = run_quickstart(out=str(tmp_path / "a"), seed=3, steps=PLAN, stop_at=STOP_AT, replanned=REPLANNED, **SMALL)
    written = json.loads((tmp_path / "a" / PLAN_FILE).read_text())
    assert written["steps"] == PLAN and written["stop_at"] == STOP_AT and written["source"] == "pinned (--plan)"
    assert written["replanned"] == REPLANNED
    assert written["cpu_matmuls"] == measured and first["plan"] == written
    assert (first["stages"][0]["steps"], first["stages"][0]["planned_steps"]) == (4, 6)
    assert f"--seed 3 --plan {(tmp_path / 'a' / PLAN_FILE).resolve()} --minutes 5 --corpus bundled" in \
        first["commands"]["rerun"]
    measured["forward"] = False
    again = run_quickstart(out=str(tmp_path / "b"), seed=3, **load_plan(tmp_path / "a" / PLAN_FILE), **SMALL)
    assert all(stage["cpu_matmuls"] == written["cpu_matmuls"] for stage in again["stages"])
    assert numbers(again) == numbers(first)
    task = first["stages"][-1]["eval"]["task"]
    assert task["n"] == SMALL["eval_problems"] and len(task["interval"]) == 2
    weights = [load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("a", "b")]
    assert all(weights[0][name].equal(weights[1][name]) for name in weights[0])
    report = (tmp_path / "a" / "report.md").read_text(encoding="utf-8")
    assert "bits/byte en" in report
    # a few hundred tokens of worked problems, at the share's cap: the report says the budget was too short
    shortfall, pretrain = first["task_shortfall"], first["stages"][0]
    assert shortfall["task_tokens"] == pretrain["task_tokens"] == int(pretrain["tokens"] * ARITHMETIC_MAX_SHARE) > 0
    assert f"`--minutes {shortfall['minutes']}` gives them" in report


def test_task_data_of_a_run_asks_no_held_out_problem(tmp_path):
    """The generated pre-training lines, SFT conversations, DPO pairs and GRPO prompts of a
    run all come from the training pool."""
    import re

    from astrai.dataset.arithmetic import heldout_problems, problem_key
    from astrai.quickstart.from_scratch import Quickstart

    qs = Quickstart(Settings(out=str(tmp_path), **{**SMALL, "pretrain_arithmetic": 2000}))
    qs.stage_corpus()
    lines = qs.arithmetic_text()
    assert str(lines) not in qs.corpus["train"]  # a dataset of its own, mixed in by share
    files = [lines, *qs.arithmetic_data().values()]
    text = "".join(path.read_text(encoding="utf-8") for path in files)
    asked = {(int(a), op, int(b)) for a, op, b in re.findall(r"(\d+)([+-])(\d+)", text)}
    assert len(asked) > 2000 and not asked & {problem_key(p) for p in heldout_problems()}
    first = json.loads(lines.read_text(encoding="utf-8").splitlines()[0])["text"].splitlines()[0]
    a, op, b, answer = re.match(r"(?:What is )?(\d+)([+-])(\d+)\D.*\D(\d+)$", first).groups()
    assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_worked_problems_in_the_chat_template_reach_pretraining_as_sft_and_the_evaluation_tokenise_them(tmp_path):
    """Pre-training's worked problems in the chat template (``arithmetic_chat_share``): each
    document, encoded as pre-training encodes text, is its fifty conversations token for token
    as the chat template gives them (the evaluation's prompt and SFT's conversation), drawn from
    the training pool."""
    from astrai.dataset.arithmetic import heldout_problems, problem_key, training_problems, worked_conversation
    from astrai.dataset.records import RecordEncoder
    from astrai.quickstart.from_scratch import Quickstart

    qs = Quickstart(Settings(out=str(tmp_path), **{**SMALL, "pretrain_arithmetic": 120}))
    qs.stage_corpus()
    qs.stage_tokenizer()
    path = qs.arithmetic_text(chat=True)
    assert path != qs.arithmetic_text()  # a dataset beside the plain lines
    documents = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(documents) == 3  # 50 + 50 + 20
    problems = training_problems(120, seed=6000 + qs.s.seed)
    assert not {problem_key(p) for p in problems} & {problem_key(p) for p in heldout_problems()}
    encoder = RecordEncoder(qs.tokenizer, "seq")
    for number, document in enumerate(documents):
        pieces, build = encoder.prepare(document)
        tokens = build(encoder.encode_pieces(pieces)).tolist()
        conversations = [qs.tokenizer.apply_chat_template(worked_conversation(p)["messages"], tokenize=True)
                         for p in problems[50 * number:50 * number + 50]]
        assert tokens == [t for ids in conversations for t in ids] + [qs.tokenizer.eos_id]


def test_a_pretraining_text_with_chat_conversations_has_its_model_asked_through_the_template(tmp_path):
    """With worked problems in the chat template in pre-training, the pre-trained model is asked
    the task as the later stages are, and the report says so; a run without them continues the
    problem as plain text."""
    chat = run_quickstart(out=str(tmp_path / "chat"), seed=0, steps=PLAN, arithmetic_chat_share=0.5, **SMALL)
    plain = run_quickstart(out=str(tmp_path / "plain"), seed=0, steps=PLAN, arithmetic_chat_share=0.0, **SMALL)
    config = json.loads((tmp_path / "chat" / "stages" / "pretrain" / "train_config.json").read_text())
    rates = {Path(d["path"]).name: d["rate"] for d in config["datasets"]}
    assert rates["arithmetic"] > 0 and rates["arithmetic_chat"] == pytest.approx(rates["arithmetic"])
    assert [s["eval"]["samples_chat"] for s in chat["stages"]] == [True] * 4
    assert [s["eval"]["samples_chat"] for s in plain["stages"]] == [False, True, True, True]
    chat_report = (tmp_path / "chat" / "report.md").read_text(encoding="utf-8")
    plain_report = (tmp_path / "plain" / "report.md").read_text(encoding="utf-8")
    assert "pre-training too (its text held worked problems as chat conversations)" in chat_report
    assert "continued as plain text" not in chat_report and "continued as plain text" in plain_report


@pytest.mark.parametrize("content,message", [
    (None, "file not found"),
    ("not json", "expected JSON with a 'steps' object"),
    (json.dumps({"steps": {"pretrain": 5}}), "positive integer for each of pretrain, sft, dpo, grpo"),
    (json.dumps({"steps": {"pretrain": 5, "sft": 0, "dpo": 1, "grpo": 1}}), "positive integer"),
    (json.dumps({"steps": {"pretrain": 5, "sft": 1, "dpo": 1, "grpo": 1}, "stop_at": {"pretrain": 6}}),
     "'stop_at' must give"),
    (json.dumps({"steps": {"pretrain": 5, "sft": 1, "dpo": 1, "grpo": 1}, "stop_at": {"rm": 1}}), "'stop_at' must give"),
    (json.dumps({"steps": {"pretrain": 5, "sft": 1, "dpo": 1, "grpo": 1},
                 "replanned": {"pretrain": {"at_step": 5, "first_steps": 9}}}), "'replanned' must give"),
    (json.dumps({"steps": {"pretrain": 5, "sft": 1, "dpo": 1, "grpo": 1},
                 "replanned": {"pretrain": {"at_step": 2}}}), "'replanned' must give"),
    (json.dumps({"steps": {"pretrain": 5, "sft": 1, "dpo": 1, "grpo": 1}, "cpu_matmuls": {"forward": 1}}),
     "'cpu_matmuls' must be"),
])
def test_bad_plan_files_are_refused(tmp_path, capsys, content, message):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_plan(path)
    assert main(["quickstart", "--plan", str(path), "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_plan_and_settings_that_name_the_decision_cpu_products_are_read(tmp_path):
    """Plans and run directories written before the decision was named ``cpu_matmuls`` call it
    ``cpu_products``: a ``--plan`` still pins it, and a resumed run still keeps it and writes
    it into its plan."""
    decision = {"forward": True, "weight_grad": False}
    done = {"name": "pretrain", "steps": 6, "planned_steps": 6, "cpu_products": decision}
    assert plan_of([done], pinned=False)["cpu_matmuls"] == decision
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"steps": PLAN, "cpu_products": decision}))
    assert load_plan(plan)["cpu_matmuls"] == decision
    fields = dict(Settings(out=str(tmp_path)).__dict__)
    del fields["cpu_matmuls"]
    (tmp_path / "settings.json").write_text(json.dumps({**fields, "cpu_products": decision}))
    assert resumed_settings(Settings(out=str(tmp_path))).cpu_matmuls == decision
