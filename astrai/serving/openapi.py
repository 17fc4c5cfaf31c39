"""The OpenAPI document (``/openapi.json``, browsable at ``/docs``).

Request bodies are read and checked by the app itself (size limit, content type,
nesting), not by FastAPI, so FastAPI cannot see them: ``install_openapi`` adds each
route's request schema from the pydantic models in schemas.py. The response models
here exist only to document the JSON the handlers build, so that client generators
and schema-driven testers (schemathesis) know every route's shapes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: str
    error: AnthropicErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class _OpenAIResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    usage: Usage


class ChatCompletion(_OpenAIResponse):
    """``chat.completion``; with ``stream: true`` a ``text/event-stream`` of ``chat.completion.chunk`` instead."""

    choices: list[ChatChoice]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class Completion(_OpenAIResponse):
    """``text_completion``; with ``stream: true`` a ``text/event-stream`` of them instead."""

    choices: list[CompletionChoice]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    """An Anthropic ``message``; with ``stream: true`` a ``text/event-stream`` of message events instead."""

    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    """OpenAI's list; with an ``anthropic-version`` header, Anthropic's (``data``, ``has_more``, ...)."""

    data: list[dict[str, Any]]
    object: Optional[str] = None
    has_more: Optional[bool] = None


class Health(BaseModel):
    status: str
    ready: bool
    model: str
    error: Optional[str] = None


class Readiness(BaseModel):
    ready: bool
    model: str


def error_responses(anthropic: bool = False) -> dict:
    model = AnthropicError if anthropic else OpenAIError
    return {status: {"model": model, "description": meaning} for status, meaning in (
        (400, "bad JSON or UTF-8, bad Host, a refusal naming the problem"), (401, "API key missing or wrong"),
        (404, "unknown model"), (413, "body too large"), (415, "body not sent as JSON"),
        (422, "body breaks the schema"), (503, "busy or still loading"))}


# one server-sent event, as readers split a stream: ``data`` is a JSON chunk of the protocol (or
# OpenAI's closing ``[DONE]``), ``event`` its type on the Anthropic routes
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"event": {"type": "string"},
                                                                    "data": {"type": "string"}}}


def streamed(model: type[BaseModel], anthropic: bool = False) -> dict:
    """A POST route's responses: the JSON ``model``, an SSE stream, or an error."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **error_responses(anthropic)}


def narrow_to_server(schemas: dict, model_name: str, vocab_size: Optional[int]) -> None:
    """What this server takes beyond the protocols' shapes: the one ``model`` id it serves and
    (once the model is loaded) token ids within its vocabulary, so that a schema-driven client
    or tester sends nothing that the document allows and the server then refuses."""
    for schema in schemas.values():
        if "model" in schema.get("properties", {}):
            schema["properties"]["model"] = {"title": "Model", "type": "string", "enum": [model_name]}
    if vocab_size is None:
        return
    pending = [schemas["CompletionRequest"]["properties"]["prompt"]]
    while pending:
        node = pending.pop()
        if node.get("type") == "integer":
            node.update(minimum=0, maximum=vocab_size - 1)
        pending.extend(node.get("anyOf", []))
        if isinstance(node.get("items"), dict):
            pending.append(node["items"])


def install_openapi(app: FastAPI, request_models: dict[str, type[BaseModel]], model_name: str,
                    vocab_size: Callable[[], Optional[int]]) -> None:
    """Build the document, with ``request_models`` (path -> body model) as POST request bodies,
    narrowed to this server (``narrow_to_server``); kept once ``vocab_size()`` is known."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _, definitions = models_json_schema([(m, "validation") for m in request_models.values()],
                                            ref_template="#/components/schemas/{model}")
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(definitions.get("$defs", {}))
        vocab = vocab_size()
        narrow_to_server(schemas, model_name, vocab)
        for path, model in request_models.items():
            document["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        if vocab is not None:
            app.openapi_schema = document
        return document

    app.openapi = openapi
