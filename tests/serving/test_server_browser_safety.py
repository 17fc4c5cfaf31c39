"""A keyless local server is safe from the web pages its user visits: only JSON bodies
(no CORS-free "simple" posts) and only the Host names it was bound to (no DNS rebinding)."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import MODEL_NAME, live_server

from astrai.serving import create_app
from astrai.serving.hosts import default_allowed_hosts

BODY = '{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL_NAME


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_non_json_posts_get_415_and_run_nothing(server_url, tiny_engine, content_type):
    before = tiny_engine.get_stats()["requests_finished"]
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        resp = httpx.post(server_url + path, content=BODY.encode(), headers=headers, timeout=30)
        assert resp.status_code == 415, resp.text
        assert "application/json" in resp.text
    assert tiny_engine.get_stats()["requests_finished"] == before


def test_json_with_a_charset_is_accepted(server_url):
    resp = httpx.post(server_url + "/v1/completions", content=BODY.encode(),
                      headers={"content-type": "application/json; charset=utf-8"}, timeout=30)
    assert resp.status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example"])
def test_foreign_host_header_is_refused(server_url, host):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/")):
        resp = httpx.request(method, server_url + path, content=BODY.encode(),
                             headers={"host": host, "content-type": "application/json"}, timeout=30)
        assert resp.status_code == 400 and "--allowed-hosts" in resp.json()["error"]["message"]
    assert httpx.get(server_url + "/health", headers={"host": host}).status_code == 200  # probes by IP


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"])
def test_loopback_names_are_answered(server_url, host):
    assert httpx.get(server_url + "/v1/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_opens_named_hosts_and_subdomains(tiny_engine):
    app = create_app(tiny_engine, model_name=MODEL_NAME, allowed_hosts=["api.example.com", "*.corp.example"])
    with live_server(app) as url:
        for host, status in (("api.example.com", 200), ("a.corp.example:80", 200), ("localhost", 400),
                             ("evil.example", 400)):
            assert httpx.get(url + "/v1/models", headers={"host": host}).status_code == status, host


def test_default_policy_follows_bind_address_key_and_flag():
    assert set(default_allowed_hosts("127.0.0.1", None, None)) == {"localhost", "127.0.0.1", "::1"}
    assert "10.0.0.5" in default_allowed_hosts("10.0.0.5", None, None)
    assert "*" not in default_allowed_hosts("0.0.0.0", None, None)  # every interface but no key: still guarded
    assert default_allowed_hosts("0.0.0.0", "sk-key", None) == ["*"]
    assert default_allowed_hosts("0.0.0.0", "sk-key", ["a.example"]) == ["a.example"]
