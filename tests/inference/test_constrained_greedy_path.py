"""Greedy constrained rows take the argmax path: the plain argmax when their language allows
it, else the argmax of their own masked row, never the full sampler over the batch. The
tokens must be the ones the full sampler gives; the engine's ``sample_paths`` statistic
shows which path chose each token."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams, executor
from astrai.inference.constraints import ConstraintCompiler
from astrai.inference.task import Task
from inference_helpers import make_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}
# greedy and sampled, free and constrained, one greedy constrained row with a penalty (full sampler)
ROWS = [
    dict(temperature=0.0, json_schema=SCHEMA),
    dict(temperature=0.0),
    dict(temperature=1.0, seed=5, json_schema=SCHEMA),
    dict(temperature=0.0, json_schema=SCHEMA),
    dict(temperature=0.8, top_k=50, seed=6),
    dict(temperature=0.0, repetition_penalty=1.3, json_schema=SCHEMA),
]


def force_full_sampler(monkeypatch) -> None:
    """Every row through the full sampler, as if each had a penalty (the penalties stay 0)."""
    monkeypatch.setattr(executor, "_has_penalty", lambda params: True)


def logits_sampler(vocab_size: int) -> executor.Executor:
    """An executor whose ``sample`` is fed logits by the test (it never runs a model)."""
    runner = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size)),
                             device=torch.device("cpu"))
    return executor.Executor(runner)


def sampler_steps(tokenizer, vocab_size: int, rows: list[dict], steps: int, forced: bool, monkeypatch) -> tuple:
    """Each row's tokens over ``steps`` calls of ``Executor.sample`` on the same seeded random
    logits (the model's padded ids past the tokenizer's biased to win every other step), and the
    path counts."""
    if forced:
        force_full_sampler(monkeypatch)
    compiler = ConstraintCompiler(tokenizer, tokenizer.stop_ids)
    sampler = logits_sampler(vocab_size)
    params = [SamplingParams(max_tokens=steps, **row) for row in rows]
    tasks = [Task(f"t{i}", [1, 2, 3], p, generator=None if p.seed is None else torch.Generator().manual_seed(p.seed),
                  constraint=compiler.compile(p)) for i, p in enumerate(params)]
    logits_source = torch.Generator().manual_seed(0)
    outputs = [[] for _ in tasks]
    for step in range(steps):
        live = [i for i, t in enumerate(tasks) if t.constraint is None or not t.constraint.finished]
        logits = torch.randn(len(live), vocab_size, generator=logits_source) * 3
        logits[:, tokenizer.vocab_size:] += 20 * (step % 2)
        for i, (token, _) in zip(live, sampler.sample([tasks[i] for i in live], logits)):
            task = tasks[i]
            if task.constraint is not None:
                assert task.constraint.consume(token) is None
            task.output_ids.append(token)
            task.context.append(token)
            outputs[i].append(token)
    monkeypatch.undo()
    return outputs, dict(sampler.sample_paths)


@pytest.mark.parametrize("padding", [0, 40])  # the model's vocabulary as the tokenizer's, and padded past it
def test_greedy_constrained_rows_choose_what_the_full_sampler_chooses(tokenizer, monkeypatch, padding):
    vocab_size = tokenizer.vocab_size + padding
    fast, paths = sampler_steps(tokenizer, vocab_size, ROWS, 40, False, monkeypatch)
    full, forced_paths = sampler_steps(tokenizer, vocab_size, ROWS, 40, True, monkeypatch)
    assert fast == full
    for row, tokens in zip(ROWS, fast):
        if "json_schema" in row:
            jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)
    greedy_constrained = sum(len(t) for row, t in zip(ROWS, fast) if row == dict(temperature=0.0, json_schema=SCHEMA))
    full_rows = sum(len(t) for row, t in zip(ROWS, fast) if row["temperature"] > 0 or "repetition_penalty" in row)
    assert paths["sampler"] == full_rows and forced_paths["sampler"] == sum(map(len, fast))
    assert paths["masked_argmax"] > 0 and paths["argmax"] > len(fast[1])  # both branches, not only the free row's
    assert paths["argmax"] + paths["masked_argmax"] == greedy_constrained + len(fast[1])


def test_a_greedy_constrained_row_alone_takes_the_argmax_path(tokenizer, monkeypatch):
    fast, paths = sampler_steps(tokenizer, tokenizer.vocab_size, ROWS[:1], 40, False, monkeypatch)
    full, _ = sampler_steps(tokenizer, tokenizer.vocab_size, ROWS[:1], 40, True, monkeypatch)
    assert fast == full and paths["sampler"] == 0 and paths["masked_argmax"] > 0


class NoTokens:
    """llguidance's mask writer as a matcher at a dead end leaves it: no token allowed."""

    def unsafe_compute_mask_ptr(self, matchers, pointer, mask_bytes, rows) -> None:
        pass


def test_a_greedy_row_whose_language_allows_nothing_may_only_end(tokenizer, monkeypatch):
    constraint = ConstraintCompiler(tokenizer, tokenizer.stop_ids).compile(SamplingParams(regex="ab"))
    sampler = logits_sampler(tokenizer.vocab_size + 40)
    monkeypatch.setattr(sampler.masks, "_parallel", NoTokens())
    masks = sampler.masks.compute([None, constraint])
    assert masks.rows == [1] and masks.allowed[0].nonzero().flatten().tolist() == sorted(tokenizer.stop_ids)
    task = Task("t", [1, 2], SamplingParams(temperature=0.0), constraint=constraint)
    [(token, _)] = sampler.sample([task], torch.randn(1, tokenizer.vocab_size + 40))
    assert token in tokenizer.stop_ids and sampler.sample_paths["masked_argmax"] == 1


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model("tiny", vocab_size=tokenizer.vocab_size, max_len=512)


def engine_run(model, tokenizer, rows: list[dict]) -> tuple[list, dict]:
    prompt = tokenizer.encode("Describe it as JSON:")
    with InferenceEngine(model, tokenizer, max_batch_size=8, max_seq_len=512) as engine:
        results = [h.result() for h in [engine.submit(prompt, SamplingParams(max_tokens=60, ignore_eos=True, **row))
                                        for row in rows]]
        return results, engine.get_stats()["sample_paths"]


def test_in_the_engine_greedy_constrained_rows_stay_off_the_full_sampler(model, tokenizer, monkeypatch):
    results, paths = engine_run(model, tokenizer, ROWS)
    for row, result in zip(ROWS, results):
        if "json_schema" in row:
            assert result.finish_reason == "stop", result.text
            jsonschema.validate(json.loads(result.text), SCHEMA)
    full_rows = [r for row, r in zip(ROWS, results) if row["temperature"] > 0 or "repetition_penalty" in row]
    assert paths["sampler"] == sum(len(r.token_ids) for r in full_rows)
    force_full_sampler(monkeypatch)
    forced, forced_paths = engine_run(model, tokenizer, ROWS)
    assert [r.token_ids for r in forced] == [r.token_ids for r in results]
    assert forced_paths["argmax"] == forced_paths["masked_argmax"] == 0
