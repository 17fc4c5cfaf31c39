"""The FastAPI application: the route groups (routes.py), error shapes, the engine's loading, middleware.

``create_app`` wraps an engine (or a function that loads one, run in the background so
the port opens at once and ``/health`` can report readiness). Request bodies are read
in request_body.py, not by FastAPI, so each failure gets its own status and a message in
the protocol's error JSON: 413 for an oversized body, 415 for a body not sent as JSON,
400 for invalid UTF-8 or JSON or a ``Host`` header the server does not answer (see
hosts.py), 422 for a body that parses but breaks the schema, 401 for a missing or wrong key,
404 for an unknown model, 503 (with ``Retry-After``) when the engine's queue is full.
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from astrai import __version__
from astrai.errors import AstraiError

from .accesslog import AccessLogMiddleware
from .app_context import AppContext
from .errors import APIError, describe_validation_errors, error_body, is_anthropic_path
from .hosts import LOCAL_NAMES, AllowedHostsMiddleware
from .openapi import install_openapi
from .routes import add_anthropic_routes, add_chat_page, add_model_routes, add_openai_routes, add_operation_routes
from .schemas import ChatCompletionRequest, CompletionRequest, CountTokensRequest, MessagesRequest

logger = logging.getLogger("astrai.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20


def create_app(engine=None, *, load_engine: Optional[Callable[[], object]] = None, tokenizer=None,
               model_name: str = "astrai", api_key: Optional[str] = None,
               cors_origins: Optional[list[str]] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               default_max_tokens: int = 512, allowed_hosts: Optional[list[str]] = None,
               metrics_public: bool = False, on_load_error: Optional[Callable[[Exception], None]] = None) -> FastAPI:
    """Build the app around ``engine``, or around what ``load_engine()`` returns once loaded.

    ``allowed_hosts`` lists the ``Host`` names answered (``*`` any, ``*.example.com``
    subdomains); by default only the loopback names, as for a server bound to 127.0.0.1.

    With an ``api_key``, ``/stats`` and ``/metrics`` need it as the /v1 routes do (they tell
    anyone who can reach the port how busy the server is and what it serves) unless
    ``metrics_public``, for a scraper that sends no key; ``/health`` never does.

    With ``load_engine`` the engine is built in a background thread when the app starts
    and shut down when it stops; until it is ready ``/health`` says so and /v1 routes
    answer 503. If loading fails, ``on_load_error`` gets the exception.
    """
    if (engine is None) == (load_engine is None):
        raise ValueError("pass exactly one of engine= or load_engine=")
    ctx = AppContext(tokenizer=tokenizer, model_name=model_name, api_key=api_key, metrics_public=metrics_public,
                     max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens)
    if engine is not None:
        ctx.install(engine)
    app = FastAPI(title="astrai", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", lifespan=engine_lifespan(ctx, load_engine, on_load_error),
                  description="OpenAI- and Anthropic-compatible API of an astrai model (see docs/serving.md).")
    app.state.metrics = ctx.metrics
    add_error_handlers(app)
    add_operation_routes(app, ctx)
    add_chat_page(app)
    add_model_routes(app, ctx)
    add_openai_routes(app, ctx)
    add_anthropic_routes(app, ctx)
    install_openapi(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest},
                    model_name, lambda: None if ctx.state is None else ctx.state.tokenizer.vocab_size)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"])
    app.add_middleware(AllowedHostsMiddleware, allowed_hosts=list(allowed_hosts or LOCAL_NAMES))
    app.add_middleware(AccessLogMiddleware, metrics=ctx.metrics)
    return app


def engine_lifespan(ctx: AppContext, load_engine: Optional[Callable[[], object]],
                    on_load_error: Optional[Callable[[Exception], None]]):
    """The app's lifespan: with ``load_engine``, the engine is built on a thread of its own when
    the app starts (the port is open meanwhile) and shut down when it stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader_thread = None
        stop = threading.Event()
        if load_engine is not None:
            def load():
                try:
                    ctx.install(load_engine())
                    logger.info("model %s loaded; ready", ctx.model_name)
                except Exception as exc:  # reported by /health, and to on_load_error (the CLI stops there)
                    ctx.error = str(exc) if isinstance(exc, AstraiError) else f"{type(exc).__name__}: {exc}"
                    logger.debug("loading the model failed", exc_info=True)
                    if on_load_error is None:
                        logger.error("loading the model failed: %s", ctx.error)
                    else:
                        on_load_error(exc)
                    return
                # The thread that built the engine stays alive while it serves: with torch's
                # OpenMP pool, an engine created by a thread that then exits decodes ~20x slower.
                stop.wait()
                ctx.state.engine.shutdown()
            loader_thread = threading.Thread(target=load, name="astrai-engine-owner", daemon=True)
            loader_thread.start()
        yield
        if loader_thread is not None:
            stop.set()
            loader_thread.join()
        if ctx.state is not None:
            ctx.state.scorer.shutdown()

    return lifespan


def add_error_handlers(app: FastAPI) -> None:
    """Every failure answers in the protocol's error JSON: an ``APIError``, an unknown route or
    method, a schema's validation error, and anything unforeseen (logged, as a 500)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            error = APIError("not_found", f"no route {request.method} {request.url.path}; see docs/serving.md")
        elif exc.status_code == 405:
            error = APIError("method_not_allowed", f"{request.method} is not allowed on {request.url.path}")
        else:
            error = APIError("invalid_request", str(exc.detail))
        response = _error_response(request, error)
        response.status_code = exc.status_code
        response.headers.update(exc.headers or {})  # e.g. 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = describe_validation_errors(list(exc.errors()))
        return _error_response(request, APIError("validation", message, param=param))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error_response(request, APIError("internal", f"internal error: {type(exc).__name__}"))


def _error_response(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error, is_anthropic_path(request.url.path)), status_code=error.status,
                        headers=error.headers())
