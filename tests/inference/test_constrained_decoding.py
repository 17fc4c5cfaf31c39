"""Constrained decoding in the engine: a randomly initialised model, which on its own would
almost never write JSON, returns output that validates against each request's schema, with
every request of a continuous batch held to its own constraint."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from astrai.errors import RequestError
from astrai.inference import InferenceEngine, SamplingParams
from inference_helpers import make_model

STRING = {"type": "string", "maxLength": 6}
SCALARS = [
    {"type": "integer", "minimum": -5, "maximum": 40},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    STRING,
    {"type": "string", "pattern": "^[a-z]{2,5}[0-9]$"},
    {"type": "null"},
]


def _value(rng: random.Random, depth: int) -> dict:
    """A bounded schema: every string, array and object closes within a few dozen tokens."""
    kind = rng.random()
    if depth >= 2 or kind < 0.5:
        return dict(rng.choice(SCALARS))
    if kind < 0.75:
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "pos"], rng.randint(1, 3))
    properties = {n: _value(rng, depth) for n in names}
    return {"type": "object", "properties": properties, "required": rng.sample(names, rng.randint(1, len(names))),
            "additionalProperties": False}


def schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = make_model("tiny", vocab_size=tokenizer.vocab_size, max_len=512)
    with InferenceEngine(model, tokenizer, max_batch_size=64, max_seq_len=512, max_queue=256) as engine:
        yield engine


def test_two_hundred_schemas_through_one_batch_all_validate(engine, tokenizer):
    prompt = tokenizer.encode("Describe it as JSON:")
    cases = schemas(200)
    handles = [engine.submit(prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=i, json_schema=schema))
               for i, schema in enumerate(cases)]
    results = [h.result() for h in handles]
    for schema, result in zip(cases, results):
        assert result.finish_reason == "stop", (schema, result.text)  # closed by the language, not cut at max_tokens
        assert result.token_ids[-1] not in tokenizer.stop_ids  # ended as the value closed, without waiting for eos
        jsonschema.validate(json.loads(result.text), schema)


def test_free_rows_in_the_same_batch_stay_free_and_each_constraint_holds_its_own_row(engine, tokenizer):
    prompt = tokenizer.encode("hello")
    kinds = [
        ("json", SamplingParams(max_tokens=60, temperature=0, json_schema={"enum": ["yes", "no"]})),
        ("free", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
        ("regex", SamplingParams(max_tokens=60, temperature=1.0, seed=3, regex=r"[0-9]{3}-[a-z]{2}")),
        ("free", SamplingParams(max_tokens=24, temperature=1.0, seed=4, ignore_eos=True)),
        ("grammar", SamplingParams(max_tokens=60, temperature=0,
                                   grammar='start: "(" item ("," item)* ")"\nitem: /[xy]/')),
    ] * 4
    free_alone = engine.submit(prompt, kinds[1][1]).result().token_ids
    handles = [engine.submit(prompt, p) for _, p in kinds]
    results = [h.result() for h in handles]
    for (kind, _), result in zip(kinds, results):
        if kind == "json":
            assert json.loads(result.text) in ("yes", "no")
        elif kind == "regex":
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", result.text), result.text
        elif kind == "grammar":
            assert re.fullmatch(r"\([xy](,[xy])*\)", result.text), result.text
        else:
            assert result.finish_reason == "length" and len(result.token_ids) == 24
        if kind != "free":
            assert result.finish_reason == "stop"
    assert results[1].token_ids == free_alone  # a greedy free row is untouched by its constrained neighbours


def test_a_lone_greedy_constrained_request_is_not_run_past_its_mask(engine, tokenizer):
    """A lone greedy request may take several decode steps per call, each the plain argmax;
    a constrained one must be masked at every token."""
    result = engine.submit(tokenizer.encode("x"), SamplingParams(max_tokens=80, temperature=0,
                                                                 regex=r"a(b|c){20}d")).result()
    assert re.fullmatch(r"a[bc]{20}d", result.text) and result.finish_reason == "stop"


def test_model_ids_past_the_tokenizers_vocabulary_are_never_drawn(tokenizer):
    """A model's vocabulary may be padded past its tokenizer's; those ids are no text."""
    model = make_model("tiny", vocab_size=tokenizer.vocab_size + 40, max_len=256)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.vocab_size:] *= 50  # padded ids would win every argmax
    with InferenceEngine(model, tokenizer, max_batch_size=4, max_seq_len=256) as engine:
        free = engine.submit(tokenizer.encode("x"), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).result()
        held = engine.submit(tokenizer.encode("x"), SamplingParams(max_tokens=40, temperature=0, regex=r"[a-z]{5}")).result()
    assert max(free.token_ids) >= tokenizer.vocab_size
    assert max(held.token_ids) < tokenizer.vocab_size and re.fullmatch(r"[a-z]{5}", held.text)


@pytest.mark.parametrize("params, words", [
    (dict(json_schema={"type": "object", "dependentSchemas": {"a": {}}}), "dependentSchemas"),
    (dict(json_schema={"type": "string", "format": "no-such-format"}), "no-such-format"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="start: missing_rule"), "missing_rule"),
    (dict(regex="a", json_schema={"type": "string"}), "at most one"),
])
def test_a_language_the_library_cannot_compile_is_refused_naming_what(engine, tokenizer, params, words):
    with pytest.raises(RequestError, match=re.escape(words)):
        engine.submit(tokenizer.encode("x"), SamplingParams(max_tokens=8, **params))


def test_a_gbnf_grammar_is_read_as_well_as_lark(engine):
    text = engine.generate("Answer:", max_tokens=20, temperature=1.0, seed=2,
                           grammar='root ::= answer "."\nanswer ::= "yes" | "no" | "maybe"')
    assert text in ("yes.", "no.", "maybe.")


def test_the_text_api_takes_a_schema(engine):
    text = engine.generate("Give a number:", max_tokens=30, temperature=0,
                           json_schema={"type": "integer", "minimum": 10, "maximum": 99})
    assert 10 <= json.loads(text) <= 99


@pytest.mark.parametrize("extreme", [
    {"repetition_penalty": 2e-109, "temperature": 1.0},  # divides positive logits past float32's range
    {"repetition_penalty": 1e300, "temperature": 0.0},  # pushes negative logits to -inf
    {"temperature": 1e-300},  # rounds to 0 in float32: no distribution to draw from
])
def test_extreme_sampling_values_keep_the_constraint(engine, tokenizer, extreme):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    prompt = tokenizer.encode("Describe it as JSON:")
    result = engine.submit(prompt, SamplingParams(max_tokens=40, seed=3, json_schema=schema, **extreme)).result()
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), schema)


def test_a_temperature_below_float32_decodes_greedily(engine, tokenizer):
    prompt = tokenizer.encode("hello")
    tiny = engine.submit(prompt, SamplingParams(max_tokens=12, temperature=1e-300, seed=1)).result()
    greedy = engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.0)).result()
    assert tiny.token_ids == greedy.token_ids


def test_masks_overlap_the_step_only_beside_a_spare_core(monkeypatch, tokenizer):
    from astrai.inference import constraints

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constraint = constraints.ConstraintCompiler(tokenizer, tokenizer.stop_ids).compile(
        SamplingParams(json_schema=schema))
    writer = constraints.MaskWriter(tokenizer.vocab_size)
    monkeypatch.setattr(constraints.os, "cpu_count", lambda: torch.get_num_threads())
    assert writer.start([constraint]) is None  # every core runs the model: written after the step
    monkeypatch.setattr(constraints.os, "cpu_count", lambda: torch.get_num_threads() + 1)
    pending = writer.start([constraint])
    assert pending is not None and pending.result().allowed.any()
