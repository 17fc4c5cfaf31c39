"""32 concurrent streaming clients: all finish, each gets its own correct output, /health stays responsive."""

from __future__ import annotations

import json
import threading
import time

import httpx
from server_helpers import MODEL_NAME

from astrai.inference.types import SamplingParams

CLIENTS = 32
PROMPTS = ["one", "two 二", "three 三个", "four four four"]
MAX_TOKENS = 8


def stream_chat(url: str, prompt: str, seed: int) -> tuple[str, str]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": seed, "ignore_eos": True, "stream": True}
    text, finish = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish


def test_32_concurrent_streams_complete_independently_while_health_answers(server_url, tiny_engine, tokenizer):
    jobs = [(PROMPTS[i % len(PROMPTS)], 100 + i % 8) for i in range(CLIENTS)]  # 8 distinct jobs, 4 clients each
    expected = {}
    for prompt, seed in set(jobs):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                            add_generation_prompt=True)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, ignore_eos=True)
        expected[prompt, seed] = tiny_engine.submit(list(ids), params).result(timeout=60).text
    assert len(set(expected.values())) == len(expected), "references must differ for the test to mean anything"

    results: dict[int, tuple[str, str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(CLIENTS + 1)

    def client(i: int) -> None:
        try:
            start.wait()
            results[i] = stream_chat(server_url, *jobs[i])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    started = time.monotonic()
    start.wait()
    health_latencies = []
    while any(t.is_alive() for t in threads) and time.monotonic() - started < 60:
        t0 = time.monotonic()
        assert httpx.get(server_url + "/health", timeout=5).json()["status"] == "ok"
        health_latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    elapsed = time.monotonic() - started
    assert not errors, errors[:3]
    assert len(results) == CLIENTS and elapsed < 60, (len(results), elapsed)
    for i, (text, finish) in results.items():
        assert text == expected[jobs[i]], f"client {i} got {text!r}, expected {expected[jobs[i]]!r}"
        assert finish == "length", (i, finish)
    assert health_latencies and max(health_latencies) < 5.0, health_latencies
