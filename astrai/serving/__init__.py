"""The HTTP server: OpenAI- and Anthropic-compatible APIs, SSE streaming, the chat page.

``create_app(engine, model_name=...)`` builds the FastAPI app around an engine;
``run_server(model_dir, ...)`` serves a model directory with uvicorn (what
``astrai serve`` calls). ``app`` is built on first access from ``$ASTRAI_MODEL``
so ``uvicorn astrai.serving:app`` also works; ``$ASTRAI_ALLOWED_HOSTS`` (comma-separated)
names the ``Host`` headers it answers, by default the loopback names only.
"""

import os

from astrai.errors import ConfigError
from astrai.inference import InferenceEngine
from astrai.inference.placement import resolve_placement
from astrai.inference.stop import StopChecker

from .anthropic_handler import AnthropicHandler
from .application import create_app
from .cli import served_model_name
from .generation import StreamContext
from .launch import run_server
from .openai_handler import OpenAICompletionHandler, OpenAIHandler
from .protocol import ProtocolHandler
from .schemas import AnthropicMessage, ChatCompletionRequest, ChatMessage, CompletionRequest, MessagesRequest

__all__ = ["create_app", "run_server", "ProtocolHandler", "OpenAIHandler", "OpenAICompletionHandler",
           "AnthropicHandler", "StreamContext", "StopChecker", "ChatMessage", "ChatCompletionRequest",
           "CompletionRequest", "AnthropicMessage", "MessagesRequest"]

_app = None


def __getattr__(name: str):
    if name != "app":
        raise AttributeError(name)
    global _app
    if _app is None:
        model_dir = os.environ.get("ASTRAI_MODEL")
        if not model_dir:
            raise ConfigError("set ASTRAI_MODEL to a model directory to use astrai.serving:app")
        device, dtype = resolve_placement(os.environ.get("ASTRAI_DEVICE", "auto"), os.environ.get("ASTRAI_DTYPE", "auto"))
        hosts = [h.strip() for h in os.environ.get("ASTRAI_ALLOWED_HOSTS", "").split(",") if h.strip()]
        _app = create_app(load_engine=lambda: InferenceEngine.from_pretrained(model_dir, device=device, dtype=dtype),
                          model_name=served_model_name(model_dir), api_key=os.environ.get("ASTRAI_API_KEY"),
                          allowed_hosts=hosts or None)
    return _app
