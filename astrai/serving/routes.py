"""The app's routes, one group per concern: operations (health, stats, metrics), the chat page,
the model list both protocols read, OpenAI's completions and Anthropic's messages. Each group
reads the app's shared state from its ``AppContext``."""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles

from .anthropic_handler import AnthropicHandler
from .app_context import AppContext
from .errors import APIError
from .openai_handler import OpenAICompletionHandler, OpenAIHandler
from .openapi import (ChatCompletion, Completion, Health, Message, ModelCard, ModelList, OpenAIError, Readiness,
                      TokenCount, error_responses, streamed)
from .schemas import ChatCompletionRequest, CompletionRequest, CountTokensRequest, MessagesRequest


def static_dir() -> str:
    return str(resources.files("astrai.serving").joinpath("static"))


def add_operation_routes(app: FastAPI, ctx: AppContext) -> None:
    """/health and /health/ready (never behind the key), /stats and /metrics."""

    @app.get("/health", responses={200: {"model": Health}})
    async def health():
        body = {"status": "ok", "ready": ctx.state is not None, "model": ctx.model_name}
        if ctx.error:
            body["error"] = ctx.error
        return body

    @app.get("/health/ready", responses={200: {"model": Readiness}, 503: {"model": Readiness}})
    async def health_ready():
        ready = ctx.state is not None
        return JSONResponse({"ready": ready, "model": ctx.model_name}, status_code=200 if ready else 503)

    @app.get("/stats", responses={200: {"model": dict[str, Any]}, 401: {"model": OpenAIError},
                                  503: {"model": OpenAIError}})
    async def stats(request: Request):
        ctx.check_metrics_key(request)
        return {"model": ctx.model_name, **ctx.ready_state().engine.get_stats()}

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: {"model": OpenAIError}})
    async def prometheus(request: Request):
        ctx.check_metrics_key(request)
        engine_stats = ctx.state.engine.get_stats() if ctx.state is not None else None
        return PlainTextResponse(ctx.metrics.render(engine_stats, ctx.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


def add_chat_page(app: FastAPI) -> None:
    """The browser chat page at / and its files under /static."""

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(f"{static_dir()}/index.html", media_type="text/html; charset=utf-8")

    app.mount("/static", StaticFiles(directory=static_dir()), name="static")


def add_model_routes(app: FastAPI, ctx: AppContext) -> None:
    """/v1/models in OpenAI's shape, or Anthropic's when the request names an anthropic-version."""

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses()})
    async def list_models(request: Request):
        ctx.check_key(request)
        name = ctx.model_name
        if "anthropic-version" in request.headers:
            return {"data": [{"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}],
                    "has_more": False, "first_id": name, "last_id": name}
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(ctx.metrics.started),
                                            "owned_by": "astrai"}]}

    @app.get("/v1/models/{model_id:path}", responses={200: {"model": ModelCard}, **error_responses()})
    async def get_model(model_id: str, request: Request):
        ctx.check_key(request)
        if model_id != ctx.model_name:
            raise APIError("not_found", f"model {model_id!r} does not exist; this server serves {ctx.model_name!r}",
                           code="model_not_found")
        return {"id": ctx.model_name, "object": "model", "created": int(ctx.metrics.started), "owned_by": "astrai"}


def add_openai_routes(app: FastAPI, ctx: AppContext) -> None:
    """OpenAI's /v1/chat/completions and /v1/completions."""

    @app.post("/v1/chat/completions", responses=streamed(ChatCompletion))
    async def chat_completions(request: Request) -> Response:
        body = await ctx.authorized_body(request, ChatCompletionRequest)
        return await OpenAIHandler(ctx.ready_state(), body, request).handle()

    @app.post("/v1/completions", responses=streamed(Completion))
    async def completions(request: Request) -> Response:
        body = await ctx.authorized_body(request, CompletionRequest)
        return await OpenAICompletionHandler(ctx.ready_state(), body, request).handle()


def add_anthropic_routes(app: FastAPI, ctx: AppContext) -> None:
    """Anthropic's /v1/messages and /v1/messages/count_tokens."""

    @app.post("/v1/messages", responses=streamed(Message, anthropic=True))
    async def messages(request: Request) -> Response:
        body = await ctx.authorized_body(request, MessagesRequest)
        return await AnthropicHandler(ctx.ready_state(), body, request).handle()

    @app.post("/v1/messages/count_tokens", responses={200: {"model": TokenCount}, **error_responses(anthropic=True)})
    async def count_tokens(request: Request):
        body = await ctx.authorized_body(request, CountTokensRequest)
        handler = AnthropicHandler(ctx.ready_state(), body, request)
        handler.check_model()
        return {"input_tokens": len(handler.build_prompt()[0])}
