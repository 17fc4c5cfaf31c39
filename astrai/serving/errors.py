"""HTTP errors in each protocol's own JSON shape.

Clients parse errors by protocol: the ``openai`` package reads
``{"error": {"message", "type", "param", "code"}}``, the ``anthropic`` package reads
``{"type": "error", "error": {"type", "message"}}``. One ``APIError`` carries the
status and message; ``error_body`` renders it for whichever protocol the route speaks
(decided by the path, so even a 404 for an unknown route reads naturally).
"""

from __future__ import annotations

from typing import Optional

# kind -> (HTTP status, OpenAI error type, Anthropic error type)
_KINDS: dict[str, tuple[int, str, str]] = {
    "invalid_request": (400, "invalid_request_error", "invalid_request_error"),
    "authentication": (401, "authentication_error", "authentication_error"),
    "not_found": (404, "not_found_error", "not_found_error"),
    "method_not_allowed": (405, "invalid_request_error", "invalid_request_error"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
    "unsupported_media_type": (415, "invalid_request_error", "invalid_request_error"),
    "validation": (422, "invalid_request_error", "invalid_request_error"),
    "overloaded": (503, "server_overloaded", "overloaded_error"),
    "not_ready": (503, "server_not_ready", "overloaded_error"),
    "internal": (500, "server_error", "api_error"),
}


class APIError(Exception):
    """An error answered to the client; ``kind`` picks the status and type names."""

    def __init__(self, kind: str, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        if kind not in _KINDS:
            raise ValueError(f"unknown API error kind {kind!r}")
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code

    @property
    def status(self) -> int:
        return _KINDS[self.kind][0]

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"} if self.kind in ("overloaded", "not_ready") else {}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(error: APIError, anthropic: bool) -> dict:
    _, openai_type, anthropic_type = _KINDS[error.kind]
    if anthropic:
        return {"type": "error", "error": {"type": anthropic_type, "message": error.message}}
    return {"error": {"message": error.message, "type": openai_type, "param": error.param, "code": error.code}}


def describe_validation_errors(errors: list[dict]) -> tuple[str, Optional[str]]:
    """Turn pydantic's error list into one readable sentence and the first field path."""
    parts = []
    first_param = None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        first_param = first_param or field
        parts.append(f"{field}: {err.get('msg', 'invalid value')}")
    more = len(errors) - len(parts)
    if more > 0:
        parts.append(f"and {more} more")
    return "invalid request: " + "; ".join(parts), first_param
