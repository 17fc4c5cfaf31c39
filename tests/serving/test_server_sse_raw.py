"""SSE framing checked byte for byte by a strict parser, and client disconnects checked through /stats."""

from __future__ import annotations

import json
import time

import httpx
from server_helpers import MODEL_NAME

ANTHROPIC_ORDER = ["message_start", "content_block_start", "ping"]


def parse_sse_strictly(raw: bytes) -> list[tuple[str | None, str]]:
    """(event, data) pairs; fails on anything the SSE standard or the protocols do not allow here."""
    text = raw.decode("utf-8")
    assert "\r" not in text, "frames must use \\n line ends"
    assert text.endswith("\n\n"), "the stream must end with a blank line after the last event"
    events = []
    for block in text[:-2].split("\n\n"):
        event, data = None, None
        for line in block.split("\n"):
            assert line, f"stray blank line in block {block!r}"
            name, sep, value = line.partition(": ")
            assert sep, f"line without 'field: value': {line!r}"
            assert name in ("event", "data"), f"unexpected field {name!r}"
            if name == "event":
                assert event is None and data is None, "event: must come once, before data:"
                event = value
            else:
                assert data is None, "exactly one data: line per event (payloads are single-line JSON)"
                data = value
        assert data is not None, f"event without data: {block!r}"
        events.append((event, data))
    return events


def post_raw(url: str, path: str, body: dict) -> httpx.Response:
    resp = httpx.post(url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    return resp


def test_openai_stream_framing_ends_with_done(server_url):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}, "n": 2, "temperature": 1.0, "seed": 1}
    events = parse_sse_strictly(post_raw(server_url, "/v1/chat/completions", body).content)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for e, d in events[:-1]]
    assert all(e is None for e, _ in events)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    finishes = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0

    completion = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 4, "stream": True}
    events = parse_sse_strictly(post_raw(server_url, "/v1/completions", completion).content)
    assert events[-1] == (None, "[DONE]")
    assert all(json.loads(d)["object"] == "text_completion" for _, d in events[:-1])


def test_anthropic_stream_has_the_documented_event_sequence(server_url):
    body = {"model": MODEL_NAME, "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    events = parse_sse_strictly(post_raw(server_url, "/v1/messages", body).content)
    names = [e for e, _ in events]
    for name, data in events:
        assert json.loads(data)["type"] == name
    assert names[:3] == ANTHROPIC_ORDER
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta"} and len(names) > 6
    delta = json.loads(events[-2][1])
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn") and delta["usage"]["output_tokens"] <= 6


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/stats").json()
        if (stats["running"] == 0 and stats["pages_used"] == 0 and stats["queue_len"] == 0) \
                or time.monotonic() > deadline:
            return stats


def test_client_disconnect_mid_stream_frees_the_task_and_its_pages(server_url):
    before = wait_idle(server_url)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "write a long text"}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 1.0, "stream": True}
    started = time.monotonic()
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server_url + "/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()  # (breaking out of a for loop over it would close the connection)
            while not ('"content":"' in (line := next(lines)) and '"content":""' not in line):
                pass
            busy = httpx.get(server_url + "/stats").json()
            assert busy["running"] == 1 and busy["pages_used"] > 0, json.dumps(busy)
    after = wait_idle(server_url)
    assert after["running"] == 0 and after["pages_used"] == 0 and after["queue_len"] == 0
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["output_tokens"] - before["output_tokens"] < 2000
    assert time.monotonic() - started < 10


def test_stop_string_match_aborts_the_engine_task(server_url):
    before = wait_idle(server_url)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
            "ignore_eos": True, "temperature": 1.0, "seed": 8}
    full = httpx.post(server_url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    stop = full["content"][3:5]
    cut = httpx.post(server_url + "/v1/chat/completions", json={**body, "stop": stop}, timeout=60).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    after = wait_idle(server_url)
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["pages_used"] == 0
