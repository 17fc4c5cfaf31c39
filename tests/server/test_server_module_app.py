"""`uvicorn astrai.inference.server:app` (serving.md): the module attribute is the ASGI app
built from $ASTRAI_MODEL, resolved the way uvicorn resolves it."""

import importlib

from fastapi.testclient import TestClient

import astrai.inference.server as server_package


def test_uvicorn_style_app_serves_the_model_in_astrai_model(tiny_model_dir, monkeypatch):
    from uvicorn.importer import import_from_string

    monkeypatch.setenv("ASTRAI_MODEL", str(tiny_model_dir))
    monkeypatch.setattr(server_package, "_app", None)
    app = import_from_string("astrai.inference.server:app")
    assert callable(app) and not hasattr(app, "__file__"), f"got {app!r}, not an ASGI app"
    with TestClient(app, base_url="http://localhost") as client:
        for _ in range(600):
            if client.get("/health/ready").status_code == 200:
                break
            importlib.import_module("time").sleep(0.05)
        reply = client.post("/v1/completions", json={"model": tiny_model_dir.resolve().name, "prompt": "hello",
                                                       "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
