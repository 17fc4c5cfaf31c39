"""`astrai serve` flags, CORS off by default, and structured access logs."""

from __future__ import annotations

import json
import logging

import httpx
from server_helpers import MODEL_NAME, ScriptedEngine, live_server

from astrai.cli import build_parser, main
from astrai.inference.server import create_app


def test_serve_flags_default_to_loopback_and_engine_limits():
    args = build_parser("serve").parse_args(["serve", "--model", "m", "--max-batch-size", "8", "--cors-origin",
                                             "http://a.example", "--cors-origin", "http://b.example"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.max_batch_size == 8 and args.page_size == 16 and args.max_queue == 256
    assert args.cors_origin == ["http://a.example", "http://b.example"]


def test_serve_reports_a_missing_model_directory(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 2
    assert "--port must be positive" in capsys.readouterr().err


def test_cors_headers_only_when_an_origin_is_allowed(tokenizer):
    origin = {"Origin": "http://ui.example"}
    with live_server(create_app(ScriptedEngine(tokenizer, "x"), model_name=MODEL_NAME)) as url:
        assert "access-control-allow-origin" not in httpx.get(url + "/v1/models", headers=origin).headers
    app = create_app(ScriptedEngine(tokenizer, "x"), model_name=MODEL_NAME, cors_origins=["http://ui.example"])
    with live_server(app) as url:
        resp = httpx.get(url + "/v1/models", headers=origin)
        assert resp.headers["access-control-allow-origin"] == "http://ui.example"
        preflight = httpx.options(url + "/v1/chat/completions", headers={
            **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        assert preflight.status_code == 200


def test_access_log_is_one_json_line_per_request_with_the_request_id(tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="astrai.server.access"):
        with live_server(create_app(ScriptedEngine(tokenizer, "hello there"), model_name=MODEL_NAME)) as url:
            resp = httpx.post(url + "/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True})
            missing = httpx.get(url + "/nope")
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "astrai.server.access"]
    by_id = {r["request_id"]: r for r in records}
    line = by_id[resp.headers["x-request-id"]]
    assert line["method"] == "POST" and line["path"] == "/v1/chat/completions" and line["status"] == 200
    assert line["bytes"] == len(resp.content) and line["duration_ms"] >= 0
    assert by_id[missing.headers["x-request-id"]]["status"] == 404
