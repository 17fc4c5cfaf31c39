"""The official ``openai`` client against a live server running the real engine (tiny random model)."""

from __future__ import annotations

import openai
import pytest
from server_helpers import MODEL_NAME

from astrai.inference.types import SamplingParams

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story 讲个故事"}]


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))


def reference(engine, prompt_ids, **sampling):
    """What the engine itself generates for these ids (the server must return exactly this)."""
    return engine.submit(prompt_ids, SamplingParams(**sampling)).result(timeout=60)


def test_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)


def test_chat_non_streaming_matches_engine_and_counts_tokens_like_the_tokenizer(client, tiny_engine, tokenizer):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=2)
    ref = reference(tiny_engine, chat_ids(tokenizer, MESSAGES), max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert resp.usage.prompt_tokens == len(chat_ids(tokenizer, MESSAGES))
    assert resp.usage.completion_tokens == ref.completion_tokens == len(choice.logprobs.content)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)


def test_max_tokens_ends_with_finish_reason_length(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5,
                                          temperature=1.0, seed=3, n=3)
    # a random model rarely emits an end token; every choice that did not must say "length" at 5 tokens
    assert resp.usage.completion_tokens <= 15
    assert any(c.finish_reason == "length" for c in resp.choices)
    assert all(c.finish_reason in ("length", "stop") for c in resp.choices)


def test_streaming_chat_equals_non_streaming_and_reports_usage(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0.8, seed=11)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    with_logprobs = list(client.chat.completions.create(**kwargs, stream=True, logprobs=True, top_logprobs=1))
    entries = [e for c in with_logprobs if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == whole.usage.completion_tokens and all(len(e.top_logprobs) == 1 for e in entries)


def test_stop_string_is_absent_and_generation_stops(client):
    base = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=5)
    full = client.chat.completions.create(**base)
    text = full.choices[0].message.content
    cut = len(text) // 2
    stop = text[cut:cut + 3]
    assert len(stop) == 3 and stop.strip(), f"reference text too short for the test: {text!r}"
    expected = text[: text.find(stop)]
    stopped = client.chat.completions.create(**base, stop=[stop, "never-matches"])
    assert stopped.choices[0].message.content == expected
    assert stop not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < full.usage.completion_tokens
    streamed = client.chat.completions.create(**base, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_n_choices_with_a_seed_are_reproducible_and_distinct(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=1234)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1
    other = client.chat.completions.create(**{**kwargs, "seed": 999})
    assert [c.message.content for c in other.choices] != texts
    streamed = client.chat.completions.create(**kwargs, stream=True)
    by_index = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] += c.delta.content or ""
    assert [by_index[i] for i in range(3)] == texts


def test_completions_endpoint_with_logprobs_echo_and_streaming(client, tiny_engine, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    ref = reference(tiny_engine, ids, max_tokens=6, temperature=0)
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    choice = resp.choices[0]
    assert resp.object == "text_completion" and choice.text == ref.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == ref.completion_tokens
    assert len(choice.logprobs.tokens) == ref.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    echoed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + ref.text
    streamed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ref.text
    batch = client.completions.create(model=MODEL_NAME, prompt=[prompt, "x"], max_tokens=6, temperature=0)
    assert batch.choices[0].text == ref.text and [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("x"))
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == ref.text
