"""The official ``anthropic`` client against a live server running the real engine (tiny random model).

Recent ``anthropic`` releases no longer take ``temperature``/``top_p``/``top_k`` as
keyword arguments; the server still reads them from the body, so tests send them
with ``extra_body`` (what users of those releases do too).
"""

from __future__ import annotations

import anthropic
import pytest
from server_helpers import MODEL_NAME

from astrai.inference.types import SamplingParams

SYSTEM = "Answer briefly."
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2? "}, {"type": "text", "text": "二加二"}]}]


@pytest.fixture(scope="module")
def client(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0, timeout=60)


def prompt_ids(tokenizer):
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2? 二加二"}]
    return list(tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True))


def test_messages_non_streaming_matches_engine_with_token_usage(client, tiny_engine, tokenizer):
    msg = client.messages.create(model=MODEL_NAME, max_tokens=9, system=SYSTEM, messages=MESSAGES,
                                 extra_body={"temperature": 0})
    ref = tiny_engine.submit(prompt_ids(tokenizer), SamplingParams(max_tokens=9, temperature=0)).result(timeout=60)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL_NAME
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref.text
    assert msg.usage.input_tokens == len(prompt_ids(tokenizer))
    assert msg.usage.output_tokens == ref.completion_tokens
    assert msg.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
    assert msg.stop_sequence is None


def test_messages_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=12, system=SYSTEM, messages=MESSAGES,
                  extra_body={"temperature": 0.9, "top_k": 50, "top_p": 0.95})
    with client.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text
    assert final.usage.output_tokens <= 12 and final.stop_reason in ("max_tokens", "end_turn")
    temp0 = dict(kwargs, extra_body={"temperature": 0})
    whole = client.messages.create(**temp0)
    with client.messages.stream(**temp0) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_stop_sequence_sets_stop_reason_and_is_cut(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=40, messages=[{"role": "user", "content": "Go on"}],
                  extra_body={"temperature": 1.0, "seed": 21})  # seed: astrai's extension to the protocol
    # find a stop sequence that first occurs mid-text
    text = client.messages.create(**kwargs).content[0].text
    stop = next(text[i:i + 2] for i in range(1, len(text) - 2) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    msg = client.messages.create(**kwargs, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.find(stop)]
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        assert "".join(stream.text_stream) == text[: text.find(stop)]
        assert stream.get_final_message().stop_reason == "stop_sequence"


def test_count_tokens_and_models(client, tokenizer):
    count = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    assert count.input_tokens == len(prompt_ids(tokenizer))
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=3, messages=MESSAGES)
