"""Multiple-choice scoring on a rigged model, greedy generation, and the evaluate() runner."""

import pytest
import torch
from torch import nn

from astrai.config import preset
from astrai.eval.generation import greedy_generate
from astrai.eval.multiple_choice import LETTERS, evaluate_multiple_choice, letter_token_ids, load_questions
from astrai.eval.suite import evaluate
from astrai.model import AutoModel


class RiggedModel(nn.Module):
    """Prefers one fixed token id above all others, whatever the input."""

    def __init__(self, vocab_size: int, favourite: int, runner_up: int):
        super().__init__()
        self.config = preset("tiny", vocab_size=vocab_size, max_len=256)
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        with torch.no_grad():
            self.bias[favourite] = 5.0
            self.bias[runner_up] = 4.0

    def forward(self, input_ids, input_mask=None, position_ids=None, **_):
        return {"logits": self.bias.expand(*input_ids.shape, -1)}


def test_mmlu_scores_the_letter_with_the_highest_likelihood(tokenizer, bundled_data):
    questions = load_questions(bundled_data / "eval" / "mmlu_sample.csv")
    assert [q.answer for q in questions] == [1, 2, 1, 3, 1, 1]
    letters = [spelling[-1] for spelling in letter_token_ids(tokenizer)]  # the token that tells letters apart
    other = tokenizer.encode(" the")[0]
    # a bigger logit on a non-letter token must not matter: only the letters compete
    model = RiggedModel(tokenizer.vocab_size, favourite=other, runner_up=letters[1])
    result = evaluate_multiple_choice(model, tokenizer, questions)
    assert result["predictions"] == ["B"] * 6
    assert result["accuracy"] == pytest.approx(4 / 6)
    model = RiggedModel(tokenizer.vocab_size, favourite=letters[3], runner_up=letters[1])
    assert evaluate_multiple_choice(model, tokenizer, questions)["accuracy"] == pytest.approx(1 / 6)


def test_mmlu_jsonl_format_with_subjects(tokenizer, bundled_data):
    questions = load_questions(bundled_data / "eval" / "mmlu_sample.jsonl")
    assert [LETTERS[q.answer] for q in questions] == ["C", "B", "C", "A", "D"]
    model = RiggedModel(tokenizer.vocab_size, favourite=letter_token_ids(tokenizer)[2][-1], runner_up=0)
    result = evaluate_multiple_choice(model, tokenizer, questions)
    assert result["accuracy"] == pytest.approx(2 / 5)
    assert result["by_subject"] == {"arithmetic": 1.0, "geography": 0.0, "language": 0.0, "science": 0.5}


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    torch.manual_seed(0)
    return AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=2, dim=32, n_heads=2,
                                        n_kv_heads=1, dim_ffn=64, max_len=128)).eval()


def test_batched_greedy_matches_one_prompt_at_a_time(tiny_model, tokenizer):
    prompts = ["Hello there", "你好，世界。今天", "1 + 1 ="]
    batched = greedy_generate(tiny_model, tokenizer, prompts, max_new_tokens=6, batch_size=3)
    alone = [greedy_generate(tiny_model, tokenizer, [p], max_new_tokens=6)[0] for p in prompts]
    assert batched == alone
    ids = tokenizer.encode("Hello there")
    reference = list(ids)
    for _ in range(6):  # plain greedy on the unpadded prompt
        reference.append(int(tiny_model(torch.tensor([reference]))["logits"][0, -1].argmax()))
    stops = set(tokenizer.stop_ids)
    expected = reference[len(ids):]
    expected = expected[:next((i for i, t in enumerate(expected) if t in stops), len(expected))]
    assert alone[0] == tokenizer.decode(expected)


def test_evaluate_runs_every_section_on_bundled_samples(tiny_model, tokenizer, bundled_data):
    problems = [("2 + 3", "5"), ("4 + 4", "8")]
    results = evaluate(
        tiny_model, tokenizer,
        heldout={"en": bundled_data / "pretrain" / "valid_en.jsonl"}, ppl_max_tokens=300,
        task=(problems, lambda p: f"What is {p[0]}?", lambda p, answer: float(answer.strip() == p[1])),
        samples=True, mmlu=[bundled_data / "eval" / "mmlu_sample.csv"], rouge=bundled_data / "eval" / "rouge_sample.jsonl",
        instructions=bundled_data / "eval" / "instructions_sample.jsonl", max_new_tokens=4,
    )
    ppl = results["perplexity"]["en"]
    assert ppl["tokens"] >= 300 and ppl["perplexity"] > 1 and ppl["unigram_perplexity"] > 1
    # an untrained model is close to uniform over the vocabulary
    assert ppl["perplexity"] == pytest.approx(tokenizer.vocab_size, rel=0.5)
    assert results["task"]["n"] == 2 and results["task"]["accuracy"] == 0.0
    assert {s["language"] for s in results["samples"]} == {"en", "zh"}
    assert results["mmlu"]["n"] == 6
    assert set(results["rouge"]) == {"rouge1", "rouge2", "rougeL", "n"}
    assert results["instructions"]["n"] == 6


def test_eval_command_writes_every_requested_section(tiny_model, tokenizer, bundled_data, tmp_path):
    import json

    from astrai.cli import main

    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "results.json"
    status = main(["eval", "--model", str(model_dir), "--heldout", f"zh={bundled_data / 'pretrain' / 'valid_zh.jsonl'}",
                   "--ppl-max-tokens", "500", "--task-problems", "3", "--no-samples", "--mmlu", str(bundled_data / "eval" / "mmlu_sample.jsonl"),
                   "--max-new-tokens", "3", "--out", str(out)])
    assert status == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    assert set(results) == {"perplexity", "task", "mmlu", "seconds"}
    assert set(results["perplexity"]) == {"zh"} and 500 <= results["perplexity"]["zh"]["tokens"] < 2000 and results["task"]["n"] == 3 and results["mmlu"]["n"] == 5


def test_bad_multiple_choice_files_name_the_line(tmp_path, capsys):
    from astrai.cli import main
    from astrai.errors import DataError

    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("Q1,a,b,c,d,A\nQ2,a,b,c,E\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.csv:2: expected 6 columns"):
        load_questions(bad_csv)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"question": "q", "choices": ["a", "b", "c", "d"], "answer": "F"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:1: answer must be a letter A-D"):
        load_questions(bad_jsonl)
    assert main(["eval", "--model", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_the_task_answer_length_applies_to_the_built_in_decoding_only(tiny_model, tokenizer):
    from astrai.errors import ConfigError
    from astrai.eval.task_accuracy import arithmetic_task

    with pytest.raises(ConfigError, match="a generator decides its own answer length"):
        evaluate(tiny_model, tokenizer, task=arithmetic_task(1), task_max_new_tokens=4,
                 generator=lambda prompts: ["1" for _ in prompts])


def test_the_engine_generator_submits_no_more_than_a_chunk_at_a_time():
    """An engine refuses more waiting requests than its queue holds: the generator feeds it
    chunks, and the answers come back in the prompts' order."""
    from astrai.eval.generation import engine_generator

    class Engine:
        submitted = []

        def generate(self, prompts, max_tokens, temperature):
            assert len(prompts) <= 4 and temperature == 0.0 and max_tokens == 7
            self.submitted.append(len(prompts))
            return [p.upper() for p in prompts]

    engine = Engine()
    prompts = [f"p{i}" for i in range(10)]
    assert engine_generator(engine, 7, chunk=4)(prompts) == [p.upper() for p in prompts]
    assert engine.submitted == [4, 4, 2]
