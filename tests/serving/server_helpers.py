"""Helpers for the server tests: a live uvicorn server in a thread and a scripted engine.

``ScriptedEngine`` is a test double that follows the engine contract (submit → handle
with ``aiter``/``abort``, ``get_stats``) but replies with fixed text, tokenized by the
real tokenizer. It exists for what a random-weight model cannot do on demand: emit a
tool call, or stream slowly enough to hang up on. Tests using it say so in their names.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from astrai.errors import OverloadedError
from astrai.inference.types import StreamEvent

MODEL_NAME = "tiny-test"


@contextmanager
def live_server(app):
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yield the base URL.

    The socket is bound here and handed to uvicorn, so no other test (or xdist worker) can
    take the port between choosing it and listening on it."""
    import uvicorn

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


@dataclass
class ScriptedHandle:
    engine: "ScriptedEngine"
    request_id: int
    prompt_tokens: int
    token_ids: list[int]
    max_tokens: int
    aborted: bool = False
    finished: bool = False
    params: object = None
    prompt_ids: list[int] = field(default_factory=list)
    events_sent: int = 0

    async def aiter(self):
        tokenizer = self.engine.tokenizer
        decoder = tokenizer.stream_decoder()
        try:
            for i, token in enumerate(self.token_ids[: self.max_tokens]):
                if self.aborted:
                    return
                await asyncio.sleep(self.engine.delay_s)
                if self.aborted:
                    return
                last = i + 1 == min(len(self.token_ids), self.max_tokens)
                text = decoder.push(token) + (decoder.flush() if last else "")
                self.events_sent += 1
                yield StreamEvent(text=text, token_ids=[token], completion_tokens=i + 1,
                                  prompt_tokens=self.prompt_tokens, finished=last,
                                  finish_reason=("length" if self.max_tokens < len(self.token_ids) else "stop")
                                  if last else None)
        finally:
            self.finished = True
            self.engine.running.discard(self.request_id)

    def abort(self) -> None:
        self.aborted = True
        self.engine.aborted.add(self.request_id)
        self.engine.running.discard(self.request_id)


class ScriptedEngine:
    """Replies with ``reply`` (as real tokens) to every request, ``delay_s`` per token."""

    def __init__(self, tokenizer, reply: str, delay_s: float = 0.0, max_queue: int = 1000):
        self.tokenizer = tokenizer
        self.reply = reply
        self.delay_s = delay_s
        self.max_queue = max_queue
        self.running: set[int] = set()
        self.aborted: set[int] = set()
        self.handles: list[ScriptedHandle] = []
        self.shut_down = False
        self._ids = itertools.count()

    def submit(self, prompt_ids, params):
        if len(self.running) >= self.max_queue:
            raise OverloadedError(f"queue full ({self.max_queue} requests)")
        handle = ScriptedHandle(self, next(self._ids), len(prompt_ids), self.tokenizer.encode(self.reply),
                                params.max_tokens, params=params,
                                prompt_ids=list(prompt_ids))
        self.running.add(handle.request_id)
        self.handles.append(handle)
        return handle

    def get_stats(self) -> dict:
        return {"queue_len": 0, "running": len(self.running), "requests_aborted": len(self.aborted)}

    def shutdown(self) -> None:
        self.shut_down = True
