"""Which ``Host`` headers the server answers, against DNS rebinding.

A web page the user visits can point its own domain at 127.0.0.1 and then talk to a
keyless local server as if same-origin. The browser still sends the page's domain in
``Host``, so answering only the names the server was bound to (and ``localhost``)
shuts that door; ``--allowed-hosts`` opens it for names a deployment really uses.
"""

from __future__ import annotations

import json
from typing import Iterable, Optional

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, error_body, is_anthropic_path

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_ADDRESS = ("0.0.0.0", "::", "")
# probes of load balancers and orchestrators address the server by IP; these reveal nothing
UNCHECKED_PATHS = ("/health", "/health/ready")


def default_allowed_hosts(host: str, api_key: Optional[str], allowed: Optional[list[str]]) -> list[str]:
    """``--allowed-hosts`` if given; any host for a keyed server on every interface; else the
    bound address and the loopback names."""
    if allowed:
        return list(allowed)
    if host in ANY_ADDRESS and api_key:
        return ["*"]
    return [*LOCAL_NAMES, *([host] if host not in ANY_ADDRESS else [])]


def host_name(header: str) -> str:
    """``Host`` without its port, lower-cased (``[::1]:8000`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(name: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        pattern = pattern.lower()
        if pattern == "*" or name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


class AllowedHostsMiddleware:
    """Answer 400 in the protocol's error shape to a request whose ``Host`` is not allowed."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]):
        self.app = app
        self.allowed_hosts = [h.strip("[]") for h in allowed_hosts]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or "*" in self.allowed_hosts or scope["path"] in UNCHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        raw = headers.get(b"host", b"").decode("latin-1")
        name = host_name(raw)
        if host_allowed(name, self.allowed_hosts):
            await self.app(scope, receive, send)
            return
        error = APIError("invalid_request", f"Host {raw!r} is not allowed here (a guard against DNS rebinding); "
                         f"allowed: {', '.join(self.allowed_hosts)}. Start the server with --allowed-hosts "
                         f"{name or 'NAME'} to answer it", param="host")
        body = json.dumps(error_body(error, is_anthropic_path(scope["path"]))).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
