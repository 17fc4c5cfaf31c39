"""Server-sent events: framing, and a response that aborts generation when the client leaves.

Every event is ``event:`` (optional) and ``data:`` lines followed by a blank line, as
the SSE standard requires; JSON payloads are single-line so one ``data:`` line always
carries one whole object. ``SSEResponse`` pumps an async iterator of frames while it
listens for ``http.disconnect``: when the client goes away the pump is cancelled and
the iterator closed at once, and closing it is what aborts the engine's tasks (their
``finally`` blocks), so no page stays held by a reader that is gone.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable, Optional

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


def sse_event(data: Any, event: Optional[str] = None) -> str:
    """One SSE frame; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


class SSEResponse(Response):
    """Streams SSE frames from ``frames``; cancels and closes it if the client disconnects.

    ``cleanup`` runs however the response ends, even if streaming never began (a client
    gone before the first byte), when closing an unstarted iterator would run no code.
    """

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[str], cleanup: Optional[Callable[[], None]] = None,
                 status_code: int = 200, headers: Optional[dict] = None):
        self.frames = frames
        self.cleanup = cleanup
        self.status_code = status_code
        self.background = None
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        self.init_headers({**base, **(headers or {})})

    async def _pump(self, send: Send) -> None:
        async for frame in self.frames:
            await send({"type": "http.response.body", "body": frame.encode("utf-8"), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _wait_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(self._wait_disconnect(receive))
            try:
                await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, watch):
                    task.cancel()
                await asyncio.gather(pump, watch, return_exceptions=True)
        finally:
            await self.frames.aclose()
            if self.cleanup is not None:
                self.cleanup()
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            exc = pump.exception()
            if not isinstance(exc, OSError):
                raise exc
