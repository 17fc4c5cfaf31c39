"""`uvicorn astrai.serving:app` (serving.md): the module attribute is the ASGI app
built from $ASTRAI_MODEL, resolved the way uvicorn resolves it."""

import importlib

from fastapi.testclient import TestClient

import astrai.serving as server_package


def test_uvicorn_style_app_serves_the_model_in_astrai_model(tiny_model_dir, monkeypatch):
    from uvicorn.importer import import_from_string

    monkeypatch.setenv("ASTRAI_MODEL", str(tiny_model_dir))
    monkeypatch.setattr(server_package, "_app", None)
    app = import_from_string("astrai.serving:app")
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


def test_the_documented_inference_server_path_gives_the_same_server(tiny_model_dir, monkeypatch):
    """``astrai.inference.server`` (serving.md) re-exports astrai.serving, ``app`` included."""
    from uvicorn.importer import import_from_string

    import astrai.inference.server as old_path

    assert old_path.create_app is server_package.create_app and old_path.run_server is server_package.run_server
    assert set(old_path.__all__) == set(server_package.__all__)
    monkeypatch.setenv("ASTRAI_MODEL", str(tiny_model_dir))
    monkeypatch.setattr(server_package, "_app", None)
    assert import_from_string("astrai.inference.server:app") is server_package.app
