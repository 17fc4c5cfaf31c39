"""``run_server``: load a model directory (or a GGUF file) behind the app and serve it with uvicorn.

The port opens at once and the model loads in the background (``/health`` reports
``ready: false`` until it is in), so process managers see a live server quickly and
load balancers can wait for readiness.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import uvicorn

from astrai.errors import AstraiError, ConfigError
from astrai.inference import InferenceEngine
from astrai.model.gguf import is_gguf

from .application import DEFAULT_MAX_BODY_BYTES, create_app
from .hosts import default_allowed_hosts

API_KEY_ENV = "ASTRAI_API_KEY"


def run_server(model_dir: str, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
               model_name: Optional[str] = None, cors_origins: Optional[list[str]] = None,
               allowed_hosts: Optional[list[str]] = None, metrics_public: bool = False,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, default_max_tokens: int = 512,
               log_level: str = "info", **engine_limits) -> None:
    """Serve ``model_dir`` (a model directory or a GGUF file) until interrupted; ``engine_limits`` go to
    ``InferenceEngine.from_pretrained``.

    A model that fails to load stops the server and raises that error (an ``AstraiError``
    naming the file), so the command exits with one clear line instead of serving 503s."""
    path = Path(model_dir)
    gguf_file = path.is_file() and is_gguf(path)
    if not ((path / "config.json").is_file() or gguf_file):
        raise ConfigError(f"--model {model_dir}: no config.json there and not a GGUF file; pass a model directory "
                          "written by save_pretrained (config.json, model.safetensors, tokenizer.json) or a .gguf file")
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    limits = {k: v for k, v in engine_limits.items() if v is not None}
    failures: list[Exception] = []

    def stop_serving(exc: Exception) -> None:  # a server that can never become ready should not linger
        failures.append(exc)
        server.should_exit = True

    app = create_app(load_engine=lambda: InferenceEngine.from_pretrained(str(path), **limits),
                     model_name=model_name or (path.stem if gguf_file else path.resolve().name), api_key=api_key, cors_origins=cors_origins,
                     max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens,
                     allowed_hosts=default_allowed_hosts(host, api_key, allowed_hosts), metrics_public=metrics_public,
                     on_load_error=stop_serving)
    logging.basicConfig(level=log_level.upper(), format="%(message)s")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    server.run()
    if failures:
        exc = failures[0]
        if isinstance(exc, AstraiError):
            raise exc
        raise ConfigError(f"--model {model_dir}: cannot be loaded ({type(exc).__name__}: {exc})") from None
