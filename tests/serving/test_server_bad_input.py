"""Bad requests get the right status and a clear message in the protocol's error shape; serving goes on."""

from __future__ import annotations

import socket

import httpx
import pytest
from server_helpers import MODEL_NAME

CHAT = "/v1/chat/completions"
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GOOD_MESSAGES = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def raw_post(url: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


CASES = [
    ("malformed JSON", CHAT, b'{"model": "tiny-test", "messages": [', 400, "not valid JSON"),
    ("not an object", CHAT, b"[1, 2]", 400, "must be a JSON object"),
    ("invalid UTF-8", CHAT, b'{"model": "tiny-test", "messages": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("missing messages", CHAT, b'{"model": "tiny-test"}', 422, "messages"),
    ("wrong type", CHAT, b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
     422, "temperature"),
    ("negative max_tokens", CHAT,
     b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', 422, "max_tokens"),
    ("unknown model", CHAT, b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "gpt-9"),
    ("image part", CHAT, b'{"model": "tiny-test", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     400, "image_url"),
    ("prompt too long", "/v1/completions", b'{"model": "tiny-test", "prompt": [' + b"5," * 2100 + b'5]}', 400, "tokens"),
    ("anthropic missing max_tokens", "/v1/messages",
     b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x"}]}', 422, "max_tokens"),
    ("seed of 2**64", CHAT, b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], '
     b'"temperature": 1, "seed": 18446744073709551616}', 422, "seed"),
    ("anthropic seed of 2**64", "/v1/messages", b'{"model": "tiny-test", "max_tokens": 2, "seed": 18446744073709551616, '
     b'"messages": [{"role": "user", "content": "x"}]}', 422, "seed"),
    ("lone surrogate in a message", CHAT, b'{"model": "tiny-test", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     400, "surrogate"),
    ("lone surrogate in a prompt", "/v1/completions", b'{"model": "tiny-test", "prompt": "a\\udc00b"}', 400, "surrogate"),
    ("lone surrogate in anthropic", "/v1/messages",
     b'{"model": "tiny-test", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "surrogate"),
    ("boolean seed", CHAT, b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "seed": true}',
     422, "seed"),
    ("boolean temperature", CHAT,
     b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "temperature": false}', 422, "temperature"),
    ("boolean top_logprobs", CHAT, b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], '
     b'"logprobs": true, "top_logprobs": true}', 422, "top_logprobs"),
    ("boolean token ids", "/v1/completions", b'{"model": "tiny-test", "prompt": [true, false]}', 422, "prompt"),
    ("more choices than the queue holds", "/v1/completions",
     b'{"model": "tiny-test", "max_tokens": 1, "n": 16, "prompt": [' + b'"a",' * 999 + b'"a"]}', 400, "--max-queue"),
]


@pytest.mark.parametrize("name,path,body,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_status_and_message(server_url, name, path, body, status, words):
    resp = raw_post(server_url, path, body)
    assert resp.status_code == status, resp.text
    payload = resp.json()
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error" and words in payload["error"]["message"]
    else:
        assert words in payload["error"]["message"] and payload["error"]["type"]


def test_enormous_body_is_refused_with_413_in_both_protocols(server_url):
    huge = b'{"model": "tiny-test", "messages": [{"role": "user", "content": "' + b"a" * 200_000 + b'"}]}'
    resp = raw_post(server_url, CHAT, huge)
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]
    resp = raw_post(server_url, "/v1/messages", huge)
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(100):
            yield b"a" * 10_000

    resp = httpx.post(server_url + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 413


def test_json_nested_100000_levels_gets_400_not_a_crash(tiny_engine):
    from starlette.testclient import TestClient

    from astrai.serving import create_app

    deep = b'{"model": "tiny-test", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with TestClient(create_app(tiny_engine, model_name=MODEL_NAME), base_url="http://localhost",
                    raise_server_exceptions=False) as client:
        for path in (CHAT, "/v1/completions", "/v1/messages"):
            resp = client.post(path, content=deep, headers={"content-type": "application/json"})
            assert resp.status_code == 400, resp.text
            assert "nested" in resp.text
        shallow = b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x", "name": ' \
                  + b"[" * 50 + b"]" * 50 + b"}]}"
        resp = client.post(CHAT, content=shallow, headers={"content-type": "application/json"})
        assert resp.status_code == 422 and "nested" not in resp.text


def test_unknown_route_and_method_are_404_and_405(server_url):
    resp = httpx.get(server_url + "/v1/nothing-here")
    assert resp.status_code == 404 and "no route" in resp.json()["error"]["message"]
    resp = httpx.get(server_url + CHAT)
    assert resp.status_code == 405


def test_server_keeps_serving_after_bad_input(server_url):
    for _ in range(3):
        raw_post(server_url, CHAT, b"{oops")
    assert httpx.post(server_url + CHAT, json=GOOD_CHAT, timeout=30).status_code == 200
    assert httpx.post(server_url + "/v1/messages", json=GOOD_MESSAGES, timeout=30).status_code == 200
    assert httpx.get(server_url + "/health").json()["ready"] is True


def test_metrics_are_prometheus_text_with_engine_gauges(server_url):
    httpx.post(server_url + CHAT, json=GOOD_CHAT, timeout=30)
    resp = httpx.get(server_url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    lines = resp.text.splitlines()
    assert "# TYPE astrai_http_requests_total counter" in lines
    assert any(l.startswith('astrai_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}')
               for l in lines)
    assert any(l.startswith("astrai_engine_pages_total ") for l in lines)
    assert any(l.startswith("astrai_generation_tokens_total ") and float(l.split()[1]) > 0 for l in lines)
    for line in lines:
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            float(value)
            assert name_labels.startswith("astrai_")


def test_a_declared_oversized_body_is_refused_before_it_is_read(server_url):
    """Content-Length over the limit: 413 naming the declared size, without reading the body."""
    host, port = server_url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {10**9}\r\n\r\n{{}}".encode())
        reply = b""
        while b"}}" not in reply and (chunk := conn.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"is 1000000000 bytes" in reply, reply


def test_json_nested_past_the_depth_limit_but_within_python_recursion_gets_400(server_url):
    nested = b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x", "name": ' \
             + b"[" * 80 + b"]" * 80 + b"}]}"
    resp = raw_post(server_url, CHAT, nested)
    assert resp.status_code == 400 and "nested more than 64 levels" in resp.json()["error"]["message"]
