"""Reading a request body: the size limit enforced while reading, JSON only, valid UTF-8, no
nesting deeper than any later walk can take, no lone surrogates, and the schema's model.

Bodies are read here rather than by FastAPI so that each failure gets its own status and a
message in the protocol's error JSON (413, 415, 400, 422; see application.py).
"""

from __future__ import annotations

import json

from fastapi import Request
from pydantic import ValidationError

from .errors import APIError, describe_validation_errors

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
