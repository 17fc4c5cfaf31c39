"""`astrai serve` flags, CORS off by default, and structured access logs."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from server_helpers import MODEL_NAME, ScriptedEngine, live_server

from astrai.cli import build_parser, main
from astrai.serving import create_app


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


def test_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from astrai.serving import cli as serve_cli

    seen = {}
    monkeypatch.setattr("astrai.serving.launch.run_server", lambda model, **kw: seen.update(kw))
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n", encoding="utf-8")
    assert main(["serve", "--model", "m", "--api-key-file", str(key_file)]) == 0
    assert seen["api_key"] == "sk-from-file"
    assert serve_cli.read_api_key_file(str(key_file)) == "sk-from-file"
    key_file.write_text("\n", encoding="utf-8")
    assert main(["serve", "--model", "m", "--api-key-file", str(key_file)]) == 2
    assert main(["serve", "--model", "m", "--api-key-file", str(tmp_path / "absent")]) == 2


def test_serve_passes_the_speculative_flags_to_the_engine(monkeypatch):
    seen = {}
    monkeypatch.setattr("astrai.serving.launch.run_server", lambda model, **kw: seen.update(kw))
    assert main(["serve", "--model", "m"]) == 0
    assert not {"speculative", "draft_model", "draft_tokens"} & set(seen)  # unset: the engine's defaults
    assert main(["serve", "--model", "m", "--speculative", "draft", "--draft-model", "d", "--draft-tokens", "5"]) == 0
    assert (seen["speculative"], seen["draft_model"], seen["draft_tokens"]) == ("draft", "d", 5)


def test_api_key_from_the_environment_guards_the_server(tmp_path, monkeypatch):
    from astrai.serving import launch

    class Built(Exception):
        """Stops run_server once the app's settings are known."""

    def record(**settings):
        raise Built(settings)

    monkeypatch.setenv(launch.API_KEY_ENV, "sk-env")
    monkeypatch.setattr(launch, "create_app", record)
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(Built) as built:
        launch.run_server(str(tmp_path), host="0.0.0.0")
    settings = built.value.args[0]
    assert settings["api_key"] == "sk-env" and settings["allowed_hosts"] == ["*"]


def test_the_server_takes_a_gguf_file_and_refuses_other_files(tmp_path, monkeypatch):
    """A .gguf file is served as it is (named after it); a file that is neither a model
    directory nor GGUF gets the message saying what --model takes."""
    from astrai.errors import ConfigError
    from astrai.serving import launch

    class Built(Exception):
        """Stops run_server once the app's settings are known."""

    def record(**settings):
        raise Built(settings)

    monkeypatch.setattr(launch, "create_app", record)
    model = tmp_path / "tiny-chat.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(Built) as built:
        launch.run_server(str(model))
    assert built.value.args[0]["model_name"] == "tiny-chat"
    other = tmp_path / "weights.bin"
    other.write_bytes(b"not a model")
    for path in (other, tmp_path / "absent"):
        with pytest.raises(ConfigError, match="not a GGUF file"):
            launch.run_server(str(path))


def broken_copies(model_dir, root):
    """Model directories that cannot be loaded, each with the words its error must say."""
    import shutil

    def copy(name):
        shutil.copytree(model_dir, root / name)
        return root / name

    weights = copy("truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (copy("no_weights") / "model.safetensors").unlink()
    (copy("bad_config") / "config.json").write_text("{oops", encoding="utf-8")
    config = copy("unknown_type") / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "martian"}), encoding="utf-8")
    (copy("no_tokenizer") / "tokenizer.json").unlink()
    return {"truncated": ("model.safetensors", "safetensors"), "no_weights": ("no_weights", "model.safetensors"),
            "bad_config": ("config.json", "not valid JSON"), "unknown_type": ("config.json", "martian"),
            "no_tokenizer": ("no_tokenizer", "tokenizer.json")}


def test_serve_on_an_unloadable_model_exits_with_one_line_naming_the_problem(tiny_model_dir, tmp_path, capsys):
    import socket

    for name, words in broken_copies(tiny_model_dir, tmp_path).items():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        code = main(["serve", "--model", str(tmp_path / name), "--port", str(port), "--log-level", "warning"])
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        lines = [l for l in err.splitlines() if l.startswith("astrai serve: error:")]
        assert len(lines) == 1 and all(w in lines[0] for w in words), (name, err)
        assert "Traceback" not in err, (name, err)
