"""Text-level engine API with the real tokenizer: generate (str/list/stream/chat/async),
stop strings, bad input, overload, weight updates, and the two CLIs."""

from __future__ import annotations

import asyncio
import io
import json
from types import SimpleNamespace

import pytest

from astrai.errors import OverloadedError, RequestError
from astrai.inference import GenerationRequest, InferenceEngine, SamplingParams
from inference_helpers import make_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def text_model(tokenizer):
    return make_model("tiny", seed=5, vocab_size=tokenizer.vocab_size)


@pytest.fixture(scope="module")
def engine(text_model, tokenizer):
    with InferenceEngine(text_model, tokenizer, page_size=8, num_pages=96) as eng:
        yield eng


@pytest.mark.timeout(60)
def test_generate_forms_agree(engine, tokenizer):
    full = engine.generate("你好, hello", max_tokens=24, **GREEDY)
    assert isinstance(full, str)
    pieces = list(engine.generate("你好, hello", stream=True, max_tokens=24, **GREEDY))
    assert "".join(pieces) == full and all(pieces)
    ids = engine.submit(tokenizer.encode("你好, hello"), SamplingParams(max_tokens=24, **GREEDY)).result(timeout=30).token_ids
    assert tokenizer.decode(ids) == full  # pieces never split a character: they join to the plain decode
    batch = engine.generate(["你好, hello", "abc"], max_tokens=24, **GREEDY)
    assert batch[0] == full and isinstance(batch[1], str)
    messages = [{"role": "user", "content": "hi"}]
    chat = engine.generate(messages, max_tokens=8, **GREEDY)
    chat_ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    by_ids = engine.submit(list(chat_ids), SamplingParams(max_tokens=8, **GREEDY)).result(timeout=30)
    assert isinstance(chat, str) and chat == by_ids.text
    req = GenerationRequest(messages=messages, max_tokens=8, temperature=0.0)
    assert engine.generate_with_request(req) == engine.generate(messages, max_tokens=8, temperature=0.0)

    async def collect():
        return [p async for p in engine.generate_async("你好, hello", max_tokens=24, **GREEDY)]

    assert "".join(asyncio.run(collect())) == full


@pytest.mark.timeout(60)
def test_stop_string_is_cut_and_not_returned(engine, tokenizer):
    text = engine.generate("abc", max_tokens=30, **GREEDY)
    ids = engine.submit(engine.encode_prompt("abc"), SamplingParams(max_tokens=30, **GREEDY)).result(timeout=30).token_ids
    # two characters first met after the first two tokens' text, so the cut keeps some text
    start = len(tokenizer.decode(ids[:2]))
    stop = next(text[k:k + 2] for k in range(start, len(text) - 1) if text.index(text[k:k + 2]) == k)
    cut = engine.generate("abc", max_tokens=30, stop=[stop], **GREEDY)
    assert cut == text[:text.index(stop)] and len(cut) >= start > 0
    handle = engine.submit(engine.encode_prompt("abc"), SamplingParams(max_tokens=30, stop=[stop], **GREEDY))
    events = list(handle)
    assert "".join(e.text for e in events) == cut
    assert events[-1].finish_reason == "stop" and events[-1].matched_stop == stop


@pytest.mark.timeout(60)
def test_eos_stops_generation(text_model, tokenizer):
    eos = tokenizer.eos_id
    with InferenceEngine(text_model, tokenizer, page_size=8, num_pages=32) as eng:
        ids = eng.submit([1, 2, 3], SamplingParams(max_tokens=6, **GREEDY)).result(timeout=30).token_ids
        with InferenceEngine(text_model, tokenizer, page_size=8, num_pages=32, stop_ids=[ids[2]]) as eng2:
            r = eng2.submit([1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0)).result(timeout=30)
            assert r.finish_reason == "stop" and r.token_ids == ids[:ids.index(ids[2]) + 1]
        r = eng.submit([1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[ids[1]])).result(timeout=30)
        assert r.finish_reason == "stop" and r.token_ids[-1] == ids[1]
    assert eos is not None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("prompt, params, match", [
    ([], {}, "empty"),
    (list(range(1, 60)), {}, "max_seq_len|max_prompt_len"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2], {"max_tokens": -3}, "max_tokens"),
    ([1, 2], {"temperature": -0.5}, "temperature"),
    ([1, 2], {"top_p": 0.0}, "top_p"),
    ([1, 2], {"top_p": 1.5}, "top_p"),
    ([1, 2], {"top_k": -1}, "top_k"),
    ([1, 2], {"min_p": 2.0}, "min_p"),
    ([99999], {}, "token"),
    ([1, 2], {"max_tokens": 100}, "pages"),
])
def test_bad_input_is_refused_at_once(text_model, tokenizer, prompt, params, match):
    with InferenceEngine(text_model, tokenizer, max_seq_len=48, page_size=8, num_pages=5) as eng:
        with pytest.raises(RequestError, match=match):
            eng.submit(prompt, SamplingParams(**params))
        assert eng.get_stats()["queue_len"] == 0  # nothing half-queued
        # the engine keeps serving afterwards
        assert eng.submit([1, 2], SamplingParams(max_tokens=2, **GREEDY)).result(timeout=10).completion_tokens == 2
    with pytest.raises(RequestError, match="unknown sampling"):
        eng.make_params(temprature=1.0)


@pytest.mark.timeout(30)
def test_full_queue_is_overloaded(text_model, tokenizer):
    with InferenceEngine(text_model, tokenizer, max_batch_size=1, max_queue=2, page_size=8, num_pages=64) as eng:
        with pytest.raises(OverloadedError):
            for _ in range(10):
                eng.submit([1, 2, 3], SamplingParams(max_tokens=100, **GREEDY))


@pytest.mark.timeout(60)
def test_a_list_longer_than_the_queue_is_answered_whole(text_model, tokenizer):
    """generate([...]) waits for its own earlier prompts when the queue is full, and gives the
    answers each prompt gets alone; submit_waiting with nothing of the caller's to wait for
    still says the queue is full."""
    prompts = [f"prompt {i}" for i in range(7)]
    with InferenceEngine(text_model, tokenizer, max_batch_size=1, max_queue=2, page_size=8, num_pages=64) as eng:
        answers = eng.generate(prompts, max_tokens=4, temperature=0.0)
        alone = [eng.generate(p, max_tokens=4, temperature=0.0) for p in prompts]
        assert answers == alone
        params = SamplingParams(max_tokens=100, **GREEDY)
        others = [eng.submit([1, 2, 3], params)]
        next(iter(others[0]))  # running: the queue behind it is filled next
        with pytest.raises(OverloadedError):  # other callers' requests fill the queue
            for _ in range(10):
                others.append(eng.submit([1, 2, 3], params))
        with pytest.raises(OverloadedError):
            eng.submit_waiting([1, 2, 3], params, [])
        for handle in others:
            handle.abort()


@pytest.mark.timeout(30)
def test_update_weights_changes_output_and_drops_prefix_cache(tokenizer):
    a = make_model("tiny", seed=1, vocab_size=tokenizer.vocab_size)
    b = make_model("tiny", seed=2, vocab_size=tokenizer.vocab_size)
    prompt = list(range(1, 20))
    with InferenceEngine(make_model("tiny", seed=1, vocab_size=tokenizer.vocab_size), tokenizer, page_size=4,
                         num_pages=64) as eng:
        before = eng.submit(prompt, SamplingParams(max_tokens=8, **GREEDY)).result(timeout=30).token_ids
        assert eng.get_stats()["pages_cached"] > 0
        eng.update_weights(b)
        assert eng.get_stats()["pages_cached"] == 0
        after = eng.submit(prompt, SamplingParams(max_tokens=8, **GREEDY)).result(timeout=30).token_ids
        eng.update_weights(a.state_dict())
        again = eng.submit(prompt, SamplingParams(max_tokens=8, **GREEDY)).result(timeout=30).token_ids
    assert before != after and again == before


@pytest.mark.timeout(90)
def test_generate_and_chat_cli(text_model, tokenizer, tmp_path):
    from astrai.cli import main
    from astrai.inference import chat_cli

    model_dir = tmp_path / "m"
    text_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "hello", "max_tokens": 3}) + "\n"
                                       + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(model_dir), "--prompt", "你好", "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(out), "--max-tokens", "5", "--temperature", "0"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0]["prompt"] == "你好" and rows[0]["completion_tokens"] <= 5 and rows[1]["completion_tokens"] <= 3
    assert "messages" in rows[2] and isinstance(rows[2]["text"], str)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert main(["generate", "--model", str(model_dir), "--input", str(tmp_path / "bad.jsonl")]) == 2

    args = SimpleNamespace(model=str(model_dir), device="cpu", dtype="auto", max_batch_size=4, max_seq_len=None, num_pages=64,
                           page_size=8, system="be brief", max_tokens=4, temperature=0.0, top_p=None, top_k=None,
                           min_p=None, repetition_penalty=None, frequency_penalty=None, presence_penalty=None,
                           seed=None, stop=None)
    stdout = io.StringIO()
    assert chat_cli.run(args, stdin=io.StringIO("hi\n/reset\nhello again\n/exit\n"), stdout=stdout) == 0
    text = stdout.getvalue()
    assert text.count("assistant> ") == 2 and "(history cleared)" in text


def test_time_to_first_token_is_taken_when_the_token_is_sampled(text_model, tokenizer):
    import time

    with InferenceEngine(text_model, tokenizer, max_batch_size=2) as engine:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        start = time.monotonic()
        first, second = engine.submit([5, 6, 7], params), engine.submit([8, 9], params)
        assert first.time_to_first_token is None or first.time_to_first_token >= 0
        second.result()
        first.result()
        elapsed = time.monotonic() - start
    for handle in (first, second):
        assert 0 < handle.time_to_first_token <= elapsed
