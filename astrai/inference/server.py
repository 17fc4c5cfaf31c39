"""The HTTP server under the path the serving docs have long given: everything here is
``astrai.serving`` (the server's home, a package above the engine it serves), re-exported so
``from astrai.inference.server import create_app, run_server`` and
``uvicorn astrai.inference.server:app`` keep working. New code imports astrai.serving.
"""

import astrai.serving
from astrai.serving import (AnthropicHandler, AnthropicMessage, ChatCompletionRequest, ChatMessage, CompletionRequest,
                            MessagesRequest, OpenAICompletionHandler, OpenAIHandler, ProtocolHandler, StopChecker,
                            StreamContext, create_app, run_server)

__all__ = astrai.serving.__all__


def __getattr__(name: str):
    """``app``, which astrai.serving builds from ``$ASTRAI_MODEL`` on first access."""
    return getattr(astrai.serving, name)
