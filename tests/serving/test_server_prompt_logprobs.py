"""``echo`` with ``logprobs`` scores the prompt's own tokens (what evaluation harnesses read), for
text, token-id and batched prompts, with ``max_tokens`` 0 scoring without generating."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from server_helpers import MODEL_NAME

from astrai.model import AutoModel

PROMPTS = [[5, 17, 301, 42, 9, 77], [600, 3, 3, 250]]


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain_model(tiny_model_dir):
    """The same weights, loaded apart from the engine: the reference forward."""
    return AutoModel.from_pretrained(tiny_model_dir).eval()


def reference_logprobs(model, ids: list[int]) -> tuple[list[float], list[int]]:
    """Each token's log-probability after the ones before it, and the most likely token there."""
    with torch.no_grad():
        logprobs = model(torch.tensor([ids]))["logits"][0, :-1].float().log_softmax(-1)
    return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist(), logprobs.argmax(-1).tolist()


def test_echo_scores_every_prompt_token_of_a_token_id_batch(client, plain_model, tokenizer):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=1, temperature=0, logprobs=1,
                                     echo=True)
    assert [c.index for c in resp.choices] == [0, 1]
    for ids, choice in zip(PROMPTS, resp.choices):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and len(lp.tokens) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected, best = reference_logprobs(plain_model, ids)
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
        assert lp.tokens[:len(ids)] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        for top, best_id in zip(lp.top_logprobs[1:len(ids)], best):
            assert list(top) == [tokenizer.decode([best_id], skip_special_tokens=False)]
        assert lp.token_logprobs[-1] <= 0 and choice.text.startswith(tokenizer.decode(ids, skip_special_tokens=False))


def test_max_tokens_zero_with_echo_scores_without_generating(client, plain_model, tokenizer):
    texts = ["Once upon a time", "The cat"]
    resp = client.completions.create(model=MODEL_NAME, prompt=texts, max_tokens=0, logprobs=3, echo=True)
    ids = [tokenizer.encode(t) for t in texts]
    assert [c.text for c in resp.choices] == texts and resp.usage.completion_tokens == 0
    assert resp.usage.prompt_tokens == sum(map(len, ids))
    for prompt, choice in zip(ids, resp.choices):
        assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == len(prompt)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(reference_logprobs(plain_model, prompt)[0], abs=1e-4)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs[1:])


def test_streamed_echo_carries_the_prompt_logprobs(client, plain_model):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                            logprobs=1, echo=True, stream=True))
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1:] == pytest.approx(reference_logprobs(plain_model, PROMPTS[0])[0], abs=1e-4)


@pytest.mark.parametrize("extra", [{"echo": False}, {"echo": True, "stream": True}])
def test_max_tokens_zero_needs_echo_and_no_stream(server_url, extra):
    resp = httpx.post(server_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0,
                                                            "logprobs": 1, **extra}, timeout=30)
    assert resp.status_code == 400 and "max_tokens 0" in resp.json()["error"]["message"]


def test_text_offsets_count_whole_characters_when_tokens_split_them(server_url, tokenizer):
    """Chinese text and emoji make byte-level tokens that end inside a character: each offset is
    where its token's text begins in the returned text, however the characters were split."""
    text = "你好，世界！🙂🚀 emoji 測試 𝄞"
    ids = tokenizer.encode(text)
    singles = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert any("\ufffd" in s for s in singles)  # some token splits a character
    resp = httpx.post(server_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": text, "max_tokens": 0,
                                                            "echo": True, "logprobs": 0}, timeout=30).json()
    choice = resp["choices"][0]
    offsets = choice["logprobs"]["text_offset"]
    assert choice["text"] == text and len(offsets) == len(ids) and offsets[0] == 0
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    for i in range(1, len(ids)):
        before = tokenizer.decode(ids[:i], skip_special_tokens=False)
        if not before.endswith("\ufffd"):
            assert text[:offsets[i]] == before
    summed = [sum(map(len, singles[:i])) for i in range(len(ids))]
    assert offsets != summed


def test_streamed_text_offsets_equal_the_whole_response(server_url):
    body = {"model": MODEL_NAME, "prompt": "雪🙂", "max_tokens": 12, "temperature": 1, "seed": 3, "echo": True,
            "logprobs": 1, "ignore_eos": True}
    whole = httpx.post(server_url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    offsets, text = [], ""
    with httpx.stream("POST", server_url + "/v1/completions", json={**body, "stream": True}, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                offsets += (choice["logprobs"] or {}).get("text_offset", [])
    assert text == whole["text"] and offsets == whole["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    assert len(offsets) == len(whole["logprobs"]["tokens"]) and offsets[-1] > len("雪🙂")  # the completion has text
