"""The request life cycle shared by every protocol (a template method).

``ProtocolHandler.handle`` always does the same things in the same order: check the
model name, build the prompt token ids, derive one ``SamplingParams`` per choice,
submit them all to the engine, then either stream SSE frames or wait for the whole
answer (watching for the client hanging up either way). Subclasses fill in the
protocol's hooks: how a prompt is built and how start/delta/end/non-stream bodies
and errors look on the wire.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Request
from starlette.responses import JSONResponse, Response

from astrai.errors import AstraiError
from astrai.inference.types import SamplingParams

from .errors import APIError
from .generation import Delta, StreamContext, collect, merge_choices, stream_choice, submit_all
from .metrics import ServerMetrics
from .scoring import PromptScorer
from .sse import SSEResponse


@dataclass
class ServerState:
    """What every handler needs: the engine, its tokenizer, the served name and limits."""

    engine: object
    tokenizer: object
    model_name: str
    default_max_tokens: int = 512
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    scorer: PromptScorer = field(init=False)

    def __post_init__(self):
        self.scorer = PromptScorer(self.engine)

    def max_tokens_for(self, requested: Optional[int]) -> int:
        """The request's own limit or the server default (the engine stops at its context limit)."""
        return self.default_max_tokens if requested is None else requested

    @property
    def queue_capacity(self) -> Optional[int]:
        """How many requests the engine queues at once (``--max-queue``), if it says."""
        capacity = getattr(getattr(self.engine, "scheduler", None), "max_queue", None)
        return capacity if isinstance(capacity, int) else None

    def check_fits_queue(self, requests: int) -> None:
        """More choices than the queue can ever hold is the request's fault, not a busy server's."""
        capacity = self.queue_capacity
        if capacity is not None and requests > capacity:
            raise APIError("invalid_request", f"the request asks for {requests} completions (prompts x n) but this "
                           f"server queues at most {capacity} at a time (--max-queue); send fewer prompts or a "
                           "smaller n", param="prompt")


class ProtocolHandler(ABC):
    """One request: subclasses supply the protocol hooks, ``handle`` runs it."""

    def __init__(self, state: ServerState, body, request: Request):
        self.state = state
        self.body = body
        self.request = request
        self.resp_id = self.create_response_id()
        self.created = int(time.time())

    # ---- protocol hooks -------------------------------------------------------
    @abstractmethod
    def create_response_id(self) -> str: ...

    @abstractmethod
    def build_prompt(self) -> list[list[int]]:
        """Prompt token ids for each choice, in choice order."""

    @abstractmethod
    def sampling_params(self, choice: int) -> SamplingParams: ...

    @abstractmethod
    def stop_strings(self) -> list[str]: ...

    @abstractmethod
    def format_stream_start(self, contexts: list[StreamContext]) -> list[str]: ...

    @abstractmethod
    def format_stream_token(self, ctx: StreamContext, delta: Delta) -> list[str]: ...

    @abstractmethod
    def format_stream_end(self, contexts: list[StreamContext]) -> list[str]: ...

    @abstractmethod
    def format_stream_error(self, error: APIError) -> str: ...

    @abstractmethod
    def format_non_stream_response(self, contexts: list[StreamContext]) -> dict: ...

    async def prepare_reply(self) -> None:
        """Work a reply needs beyond generation, done once the engine took the requests (so
        they are refused before it starts) and before the first byte goes out."""

    def token_counts(self, contexts: list[StreamContext]) -> tuple[int, int]:
        """(prompt tokens, completion tokens) of the whole response, as usage reports them."""
        return contexts[0].prompt_tokens, sum(c.completion_tokens for c in contexts)

    def _record(self, contexts: list[StreamContext], started: float, finished: bool) -> None:
        first = min((c.first_token_at for c in contexts if c.first_token_at is not None), default=None)
        self.state.metrics.record_request(*self.token_counts(contexts), None if first is None else first - started,
                                          finished)

    # ---- the template ---------------------------------------------------------
    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    def tokenize_chat(self, messages: list[dict], tools: Optional[list] = None) -> list[int]:
        try:
            ids = self.state.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                           tools=tools)
        except AstraiError as exc:
            raise APIError("invalid_request", f"messages could not be rendered: {exc}", param="messages") from None
        return list(ids)

    def check_model(self) -> None:
        if self.body.model != self.state.model_name:
            raise APIError("not_found", f"model {self.body.model!r} does not exist; this server serves "
                           f"{self.state.model_name!r} (see GET /v1/models)", param="model", code="model_not_found")

    async def handle(self) -> Response:
        self.check_model()
        prompts = self.build_prompt()
        self.state.check_fits_queue(len(prompts))
        params = [self.sampling_params(i) for i in range(len(prompts))]
        handles = submit_all(self.state.engine, prompts, params)
        try:
            await self.prepare_reply()
        except BaseException:
            for h in handles:
                h.abort()
            raise
        contexts = [StreamContext(self.resp_id, self.state.model_name, index=i, created=self.created,
                                  prompt_tokens=len(p)) for i, p in enumerate(prompts)]
        stops = self.stop_strings()
        streams = [stream_choice(h, c, stops) for h, c in zip(handles, contexts)]
        started = time.perf_counter()
        if self.stream:
            return SSEResponse(self._frames(streams, contexts, started),
                               cleanup=lambda: [h.abort() for h in handles])
        done = await self._collect_unless_disconnected(streams)
        self._record(contexts, started, finished=done)
        if not done:
            return Response(status_code=499)
        return JSONResponse(self.format_non_stream_response(contexts))

    async def _frames(self, streams, contexts: list[StreamContext], started: float) -> AsyncIterator[str]:
        merged = merge_choices(streams)
        finished = False
        try:
            for frame in self.format_stream_start(contexts):
                yield frame
            async for delta in merged:
                for frame in self.format_stream_token(contexts[delta.index], delta):
                    yield frame
            for frame in self.format_stream_end(contexts):
                yield frame
            finished = True
        except APIError as exc:
            yield self.format_stream_error(exc)
        finally:
            await merged.aclose()
            self._record(contexts, started, finished)

    async def _collect_unless_disconnected(self, streams) -> bool:
        """Collect every choice; False if the client hung up first (the tasks are aborted)."""
        work = asyncio.ensure_future(collect(streams))
        watch = asyncio.ensure_future(self._wait_disconnect())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                task.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled():
            return False
        work.result()
        return True

    async def _wait_disconnect(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
