"""Structured access logs: one JSON line per HTTP request, written when the body ends.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware) so streaming responses
pass through untouched and the line is written when the last byte of an SSE stream
is sent, with the real duration. Each response carries an ``X-Request-ID`` that the
log line repeats, so a client's report can be matched to the server's record.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("astrai.server.access")

KNOWN_ROUTES = {"/", "/health", "/health/ready", "/stats", "/metrics", "/v1/models", "/v1/chat/completions",
                "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"}


def route_label(path: str) -> str:
    """A bounded label for metrics: known routes by name, everything else lumped together."""
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/static/"):
        return "/static"
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "unmatched"


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = secrets.token_hex(8)
        started = time.perf_counter()
        record = {"status": 500, "bytes": 0}

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body":
                record["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            seconds = time.perf_counter() - started
            path = scope.get("path", "")
            self.metrics.record_http(scope.get("method", ""), route_label(path), record["status"], seconds)
            client = scope.get("client")
            access_logger.info(json.dumps({
                "ts": round(time.time(), 3), "request_id": request_id, "client": client[0] if client else None,
                "method": scope.get("method"), "path": path, "status": record["status"],
                "bytes": record["bytes"], "duration_ms": round(seconds * 1000, 2),
            }, separators=(",", ":")))
