"""lm-evaluation-harness through ``astrai serve`` scores what its ``hf`` backend scores on the same weights.

The tiny model is exported to the Hugging Face Llama format; lm-eval then runs the same
local tasks (multiple choice, rolling perplexity, generate_until; JSONL files written
here, no hub access) once with ``local-completions`` against the live server and once
with ``hf`` on the exported copy (and generate_until once more through
``local-chat-completions``). Per-sample log-likelihoods and generations must agree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from server_helpers import live_server



QUESTIONS = [
    ("The capital of France is", [" Paris", " a river", " green"], 0),
    ("Two plus two equals", [" four", " the moon", " blue sky"], 0),
    ("The sun rises in the", [" east", " west", " cupboard"], 0),
    ("Cats like to drink", [" milk", " stones", " sand"], 0),
    ("写一个故事", ["：从前", "。", "，然后"], 1),
]
TEXTS = ["Once upon a time there was a small cat.", "The weather today is mild and clear.", "我们今天去公园。"]
PROMPTS = ["Hello, my name is", "The best thing about", "One two three", "今天天气"]


def write_tasks(root: Path) -> Path:
    data = root / "data"
    data.mkdir()
    (data / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}, ensure_ascii=False)
                                           + "\n" for q, c, a in QUESTIONS), encoding="utf-8")
    (data / "ppl.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS),
                                    encoding="utf-8")
    (data / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": " x"}, ensure_ascii=False) + "\n"
                                            for p in PROMPTS), encoding="utf-8")
    source = Path(__file__).parent / "lm_eval_tasks"
    tasks = root / "tasks"
    tasks.mkdir()
    for yaml in source.glob("*.yaml"):
        (tasks / yaml.name).write_text(yaml.read_text(encoding="utf-8").replace("DATA_DIR", str(data)),
                                       encoding="utf-8")
    return tasks


@pytest.fixture(scope="module")
def hf_dir(tiny_model_dir, tokenizer, tmp_path_factory):
    """The tiny model in the Hugging Face Llama format, with the tokenizer beside it."""
    from astrai.model import AutoModel
    from astrai.model.hf import export_llama

    out = tmp_path_factory.mktemp("hf_llama")
    export_llama(AutoModel.from_pretrained(tiny_model_dir), out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out


def evaluate(model: str, model_args: dict, tasks_dir: Path, tasks=("astrai_mc", "astrai_ppl", "astrai_gen"),
             chat: bool = False) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                           task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                           batch_size=4, log_samples=True, device="cpu", apply_chat_template=chat)


@pytest.fixture
def offline_tasks(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return write_tasks(tmp_path)


# astrai's tokenizer adds no BOS; the hf backend would (transformers adds the bos_token by default)
def hf_args(hf_dir: Path) -> dict:
    return {"pretrained": str(hf_dir), "dtype": "float32", "add_bos_token": False}


def by_doc(results: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_scores_through_the_server_equal_the_hf_backend(tiny_engine, hf_dir, offline_tasks):
    from astrai.serving import create_app

    tasks = offline_tasks
    reference = evaluate("hf", hf_args(hf_dir), tasks)
    with live_server(create_app(tiny_engine, model_name="tiny-eval")) as url:
        served = evaluate("local-completions", {"model": "tiny-eval", "base_url": f"{url}/v1/completions",
                                                "tokenizer": str(hf_dir), "tokenizer_backend": "huggingface",
                                                "num_concurrent": 1, "max_retries": 1}, tasks)

    for task in ("astrai_mc", "astrai_ppl"):
        ours, theirs = by_doc(served, task), by_doc(reference, task)
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs):
            assert [float(x[0]) if isinstance(x, (list, tuple)) else float(x) for x in a] == pytest.approx(
                [float(x[0]) if isinstance(x, (list, tuple)) else float(x) for x in b], abs=2e-3)
    mc = served["results"]["astrai_mc"]["acc,none"]
    assert mc == reference["results"]["astrai_mc"]["acc,none"]
    ppl = served["results"]["astrai_ppl"]["word_perplexity,none"]
    assert ppl == pytest.approx(reference["results"]["astrai_ppl"]["word_perplexity,none"], rel=1e-3)
    assert by_doc(served, "astrai_gen") == by_doc(reference, "astrai_gen")
    assert any(r[0].strip() for r in by_doc(served, "astrai_gen"))  # something was generated


def test_lm_eval_chat_generation_through_the_server_equals_the_hf_backend(tiny_engine, hf_dir, offline_tasks):
    """local-chat-completions: the server's chat template and the hf backend's (from
    tokenizer_config.json) render the same prompt, so greedy generations agree."""
    from astrai.serving import create_app

    reference = evaluate("hf", hf_args(hf_dir), offline_tasks, tasks=["astrai_gen"], chat=True)
    with live_server(create_app(tiny_engine, model_name="tiny-eval")) as url:
        served = evaluate("local-chat-completions", {"model": "tiny-eval", "base_url": f"{url}/v1/chat/completions",
                                                     "num_concurrent": 1, "max_retries": 1}, offline_tasks,
                          tasks=["astrai_gen"], chat=True)
    assert by_doc(served, "astrai_gen") == by_doc(reference, "astrai_gen")
    assert all(r[0] for r in by_doc(served, "astrai_gen"))  # eight tokens each, not an empty agreement
