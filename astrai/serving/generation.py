"""Protocol-neutral generation: engine handles in, text deltas with stop strings applied out.

Both protocols need the same core: submit one engine request per choice, read its
events, cut the text at the first stop string (aborting the engine task there, so its
pages are freed without generating further), count tokens, and make sure that however
the reader stops (finished, client gone, error) every engine task is aborted.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from astrai.errors import OverloadedError, RequestError
from astrai.inference.types import SamplingParams, TokenLogprob

from .errors import APIError
from astrai.inference.stop import StopChecker


@dataclass
class StreamContext:
    """The state of one choice of one response while it is generated."""

    resp_id: str
    model: str
    index: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accumulated: str = ""
    stop_matched: Optional[str] = None
    finish_reason: Optional[str] = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_at: Optional[float] = None


@dataclass
class Delta:
    """New text (and the logprobs of the tokens that produced it) for one choice."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def submit_all(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Submit one request per (prompt, params); on any refusal abort those already in."""
    handles = []
    try:
        for prompt_ids, p in zip(prompts, params):
            handles.append(engine.submit(prompt_ids, p))
    except OverloadedError as exc:
        for h in handles:
            h.abort()
        raise APIError("overloaded", f"the server is busy ({exc}); retry shortly") from None
    except RequestError as exc:
        for h in handles:
            h.abort()
        raise APIError("invalid_request", str(exc)) from None
    return handles


async def stream_choice(handle, ctx: StreamContext, stops: list[str]) -> AsyncIterator[Delta]:
    """Yield the deltas of one engine request; abort it on a stop string or early exit."""
    checker = StopChecker(stops)
    pending_logprobs: list[TokenLogprob] = []
    events = handle.aiter()
    done = False
    try:
        async for event in events:
            if event.error:
                done = True
                raise APIError("internal", f"generation failed in the engine: {event.error}")
            if event.token_ids and ctx.first_token_at is None:
                ctx.first_token_at = time.perf_counter()
            ctx.completion_tokens += len(event.token_ids)
            pending_logprobs.extend(event.logprobs)
            text = checker.push(event.text) if event.text else ""
            if checker.matched is not None:
                handle.abort()
                done = True
                ctx.stop_matched = checker.matched
                ctx.finish_reason = "stop"
            elif event.finished:
                done = True
                if event.finish_reason == "abort":
                    raise APIError("not_ready", "the engine dropped the request (it is shutting down); retry")
                text += checker.flush()
                ctx.completion_tokens = max(ctx.completion_tokens, event.completion_tokens)
                ctx.finish_reason = "length" if event.finish_reason == "length" else "stop"
            if text or (pending_logprobs and done):
                ctx.accumulated += text
                ctx.logprobs.extend(pending_logprobs)
                yield Delta(ctx.index, text, pending_logprobs)
                pending_logprobs = []
            if done:
                break
    finally:
        if not done:
            handle.abort()
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
    if not done:
        raise APIError("internal", "the engine ended the request without a final event")
    yield Delta(ctx.index, finished=True)


async def merge_choices(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Interleave several choices' deltas in arrival order; closing this closes them all."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream):
        try:
            async for delta in stream:
                await queue.put(delta)
            await queue.put(end)
        except BaseException as exc:  # forwarded to the reader, which re-raises it
            await queue.put(exc)
            raise

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def collect(streams: list[AsyncIterator[Delta]]) -> None:
    """Run all choices to the end (their contexts accumulate the results)."""
    merged = merge_choices(streams)
    try:
        async for _ in merged:
            pass
    finally:
        await merged.aclose()
