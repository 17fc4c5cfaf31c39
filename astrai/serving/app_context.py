"""What every route of one app shares: the engine once it is installed (or why loading it failed),
the served model's name, the API key, the body limit and the server's metrics."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request

from .errors import APIError
from .metrics import ServerMetrics
from .protocol import ServerState
from .request_body import parse_body, read_json_body


@dataclass(eq=False)
class AppContext:
    """One app's shared state. ``state`` stays None until ``install`` (the model may load in
    a background thread after the port opens), and ``error`` says why when loading failed."""

    tokenizer: Any
    model_name: str
    api_key: Optional[str]
    metrics_public: bool
    max_body_bytes: int
    default_max_tokens: int
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    state: Optional[ServerState] = None
    error: Optional[str] = None

    def install(self, engine) -> None:
        self.state = ServerState(engine=engine, tokenizer=self.tokenizer or engine.tokenizer,
                                 model_name=self.model_name, default_max_tokens=self.default_max_tokens,
                                 metrics=self.metrics)

    def ready_state(self) -> ServerState:
        """The installed state, or a 503 saying the model is still loading or failed to."""
        if self.state is None:
            detail = f"loading the model failed: {self.error}" if self.error else "the model is still loading"
            raise APIError("not_ready", detail)
        return self.state

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if not given or not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError("authentication", "missing or invalid API key: send 'Authorization: Bearer <key>' "
                           "or 'x-api-key: <key>'")

    def check_metrics_key(self, request: Request) -> None:
        """/stats and /metrics take the API key too, unless the server made them public."""
        if not self.metrics_public:
            self.check_key(request)

    async def authorized_body(self, request: Request, model_cls):
        """The request's body as ``model_cls``, once its key has been checked."""
        self.check_key(request)
        return parse_body(model_cls, await read_json_body(request, self.max_body_bytes))
