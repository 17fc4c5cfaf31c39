"""The FastAPI application: routes, authentication, body limits, error shapes, the chat page.

``create_app`` wraps an engine (or a function that loads one, run in the background so
the port opens at once and ``/health`` can report readiness). Request bodies are read
here, not by FastAPI, so each failure gets its own status and a message in the
protocol's error JSON: 413 for an oversized body, 415 for a body not sent as JSON,
400 for invalid UTF-8 or JSON or a ``Host`` header the server does not answer (see
hosts.py), 422 for a body that parses but breaks the schema, 401 for a missing or wrong key,
404 for an unknown model, 503 (with ``Retry-After``) when the engine's queue is full.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from contextlib import asynccontextmanager
from importlib import resources
from importlib.metadata import version
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles

from astrai.errors import AstraiError

from .accesslog import AccessLogMiddleware
from .anthropic_handler import AnthropicHandler
from .errors import APIError, describe_validation_errors, error_body, is_anthropic_path
from .hosts import LOCAL_NAMES, AllowedHostsMiddleware
from .metrics import ServerMetrics
from .openai_handler import OpenAICompletionHandler, OpenAIHandler
from .protocol import ServerState
from .openapi import (ChatCompletion, Completion, Health, Message, ModelCard, ModelList, OpenAIError, Readiness,
                      TokenCount, error_responses, install_openapi, streamed)
from .schemas import ChatCompletionRequest, CompletionRequest, CountTokensRequest, MessagesRequest

logger = logging.getLogger("astrai.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 64


def check_json_value(data) -> None:
    """Refuse what JSON allows but nothing downstream can use: nesting deeper than
    ``MAX_JSON_DEPTH`` (it would exhaust the recursion of every later walk over the body)
    and lone UTF-16 surrogates such as ``"\\ud800"`` (no tokenizer or encoder takes them)."""
    pending = [(data, 1, "body")]
    while pending:
        value, depth, where = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError("invalid_request", f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where)
                pending.append((item, depth + 1, f"{where}.{key}"))
        elif isinstance(value, list):
            pending.extend((item, depth + 1, f"{where}.{i}") for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError("invalid_request", f"{where}: a lone UTF-16 surrogate escape (\\u{ord(text[exc.start]):04x}) "
                       "is not a character; send valid Unicode", param=where) from None


def static_dir() -> str:
    return str(resources.files("astrai.serving").joinpath("static"))


def _error_response(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error, is_anthropic_path(request.url.path)), status_code=error.status,
                        headers=error.headers())


def check_json_content_type(request: Request) -> None:
    """Only JSON bodies: a web page can post text/plain or form data to any address without
    a CORS preflight, so accepting those would let any site run generations here."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError("unsupported_media_type", f"request body must be JSON sent as 'Content-Type: application/json', "
                       f"got {media or 'no Content-Type'!r}")


async def read_json_body(request: Request, limit: int) -> dict:
    """The request body as a JSON object, enforcing the size limit while reading."""
    check_json_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError("too_large", f"request body is {int(declared)} bytes; the limit is {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError("too_large", f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError("invalid_request", f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError("invalid_request", f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                       f"column {exc.colno}") from None
    except RecursionError:
        raise APIError("invalid_request", f"request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(data, dict):
        raise APIError("invalid_request", f"request body must be a JSON object, got {type(data).__name__}")
    check_json_value(data)
    return data


def parse_body(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise APIError("validation", message, param=param) from None


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
    holder: dict = {"state": None, "error": None}

    def install(eng) -> None:
        holder["state"] = ServerState(engine=eng, tokenizer=tokenizer or eng.tokenizer, model_name=model_name,
                                      default_max_tokens=default_max_tokens, metrics=metrics)

    metrics = ServerMetrics()
    if engine is not None:
        install(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader_thread = None
        stop = threading.Event()
        if load_engine is not None:
            def load():
                try:
                    install(load_engine())
                    logger.info("model %s loaded; ready", model_name)
                except Exception as exc:  # reported by /health, and to on_load_error (the CLI stops there)
                    holder["error"] = str(exc) if isinstance(exc, AstraiError) else f"{type(exc).__name__}: {exc}"
                    logger.debug("loading the model failed", exc_info=True)
                    if on_load_error is None:
                        logger.error("loading the model failed: %s", holder["error"])
                    else:
                        on_load_error(exc)
                    return
                # The thread that built the engine stays alive while it serves: with torch's
                # OpenMP pool, an engine created by a thread that then exits decodes ~20x slower.
                stop.wait()
                holder["state"].engine.shutdown()
            loader_thread = threading.Thread(target=load, name="astrai-engine-owner", daemon=True)
            loader_thread.start()
        yield
        if loader_thread is not None:
            stop.set()
            loader_thread.join()
        if holder["state"] is not None:
            holder["state"].scorer.shutdown()

    app = FastAPI(title="astrai", version=version("astrai"), docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan,
                  description="OpenAI- and Anthropic-compatible API of an astrai model (see docs/serving.md).")
    app.state.metrics = metrics

    def state() -> ServerState:
        if holder["state"] is None:
            detail = f"loading the model failed: {holder['error']}" if holder["error"] else "the model is still loading"
            raise APIError("not_ready", detail)
        return holder["state"]

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if not given or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError("authentication", "missing or invalid API key: send 'Authorization: Bearer <key>' "
                           "or 'x-api-key: <key>'")

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

    # ---- operations -------------------------------------------------------------
    @app.get("/health", responses={200: {"model": Health}})
    async def health():
        ready = holder["state"] is not None
        body = {"status": "ok", "ready": ready, "model": model_name}
        if holder["error"]:
            body["error"] = holder["error"]
        return body

    @app.get("/health/ready", responses={200: {"model": Readiness}, 503: {"model": Readiness}})
    async def health_ready():
        ready = holder["state"] is not None
        return JSONResponse({"ready": ready, "model": model_name}, status_code=200 if ready else 503)

    def check_metrics_key(request: Request) -> None:
        if not metrics_public:
            check_key(request)

    @app.get("/stats", responses={200: {"model": dict[str, Any]}, 401: {"model": OpenAIError},
                                  503: {"model": OpenAIError}})
    async def stats(request: Request):
        check_metrics_key(request)
        return {"model": model_name, **state().engine.get_stats()}

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: {"model": OpenAIError}})
    async def prometheus(request: Request):
        check_metrics_key(request)
        current = holder["state"]
        engine_stats = current.engine.get_stats() if current is not None else None
        return PlainTextResponse(metrics.render(engine_stats, model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- the chat page ----------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(f"{static_dir()}/index.html", media_type="text/html; charset=utf-8")

    app.mount("/static", StaticFiles(directory=static_dir()), name="static")

    # ---- the protocols ----------------------------------------------------------
    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses()})
    async def list_models(request: Request):
        check_key(request)
        if "anthropic-version" in request.headers:
            return {"data": [{"type": "model", "id": model_name, "display_name": model_name,
                              "created_at": "1970-01-01T00:00:00Z"}],
                    "has_more": False, "first_id": model_name, "last_id": model_name}
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(metrics.started),
                                            "owned_by": "astrai"}]}

    @app.get("/v1/models/{model_id:path}", responses={200: {"model": ModelCard}, **error_responses()})
    async def get_model(model_id: str, request: Request):
        check_key(request)
        if model_id != model_name:
            raise APIError("not_found", f"model {model_id!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found")
        return {"id": model_name, "object": "model", "created": int(metrics.started), "owned_by": "astrai"}

    @app.post("/v1/chat/completions", responses=streamed(ChatCompletion))
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        body = parse_body(ChatCompletionRequest, await read_json_body(request, max_body_bytes))
        return await OpenAIHandler(state(), body, request).handle()

    @app.post("/v1/completions", responses=streamed(Completion))
    async def completions(request: Request) -> Response:
        check_key(request)
        body = parse_body(CompletionRequest, await read_json_body(request, max_body_bytes))
        return await OpenAICompletionHandler(state(), body, request).handle()

    @app.post("/v1/messages", responses=streamed(Message, anthropic=True))
    async def messages(request: Request) -> Response:
        check_key(request)
        body = parse_body(MessagesRequest, await read_json_body(request, max_body_bytes))
        return await AnthropicHandler(state(), body, request).handle()

    @app.post("/v1/messages/count_tokens", responses={200: {"model": TokenCount}, **error_responses(anthropic=True)})
    async def count_tokens(request: Request):
        check_key(request)
        body = parse_body(CountTokensRequest, await read_json_body(request, max_body_bytes))
        handler = AnthropicHandler(state(), body, request)
        handler.check_model()
        return {"input_tokens": len(handler.build_prompt()[0])}

    install_openapi(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest},
                    model_name, lambda: None if holder["state"] is None else holder["state"].tokenizer.vocab_size)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"])
    app.add_middleware(AllowedHostsMiddleware, allowed_hosts=list(allowed_hosts or LOCAL_NAMES))
    app.add_middleware(AccessLogMiddleware, metrics=metrics)
    return app
