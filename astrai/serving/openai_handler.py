"""The OpenAI protocol: ``/v1/chat/completions`` and ``/v1/completions``.

Bodies follow OpenAI's published shapes (``chat.completion``, ``chat.completion.chunk``,
``text_completion``), so the official ``openai`` client and tools built on it work
unchanged. Choices of one request (``n``) are separate engine requests sharing a
prompt; with a ``seed`` choice *i* uses ``seed + i``, so the whole response is
reproducible while the choices still differ.
"""

from __future__ import annotations

import functools
import time
from abc import abstractmethod
from typing import Optional

from starlette.responses import JSONResponse, Response

from astrai.inference.types import SamplingParams, TokenLogprob

from .errors import APIError, error_body
from .generation import Delta, StreamContext, new_id
from .protocol import ProtocolHandler
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from .scoring import text_offsets, token_text
from .sse import sse_event
from .structured import forced_tools, one_constraint, response_format_schema, tool_call_schema
from .toolcalls import ParsedToolCall, ToolCallStreamParser, parse_tool_calls, render_tool_call

DONE_FRAME = "data: [DONE]\n\n"


class _OpenAIBase(ProtocolHandler):
    """Sampling, usage and errors common to both OpenAI endpoints."""

    body: ChatCompletionRequest | CompletionRequest

    def requested_max_tokens(self) -> Optional[int]:
        return self.body.max_tokens

    @abstractmethod
    def logprob_settings(self) -> tuple[bool, int]:
        """(whether to return logprobs, how many alternatives per token)."""

    @functools.cached_property
    def logit_bias(self) -> dict[int, float]:
        """``logit_bias`` with its keys as token ids; a key that is no token id is a 400, never ignored."""
        bias = self.body.logit_bias or {}
        vocab = self.state.tokenizer.vocab_size
        wrong = [key for key in bias if not (key.isascii() and key.isdigit() and int(key) < vocab)]
        if wrong:
            raise APIError("invalid_request", f"logit_bias keys must be token ids in [0, {vocab}) written as "
                           f"strings, got {', '.join(map(repr, wrong[:3]))}", param="logit_bias")
        return {int(key): float(value) for key, value in bias.items()}

    async def handle(self) -> Response:
        self.logit_bias  # a key that is no token id is refused before anything runs
        return await super().handle()

    def sampling_params(self, choice: int) -> SamplingParams:
        b = self.body
        want_logprobs, top = self.logprob_settings()
        seed = None if b.seed is None else b.seed + choice % b.n
        return SamplingParams(
            max_tokens=self.state.max_tokens_for(self.requested_max_tokens()),
            temperature=b.temperature, top_p=b.top_p, top_k=max(b.top_k, 0), min_p=b.min_p,
            repetition_penalty=b.repetition_penalty, frequency_penalty=b.frequency_penalty,
            presence_penalty=b.presence_penalty, logit_bias=self.logit_bias, seed=seed, ignore_eos=b.ignore_eos,
            logprobs=want_logprobs, top_logprobs=top,
            json_schema=self.output_schema())

    def output_schema(self) -> Optional[dict]:
        """The JSON Schema the reply is held to (None: free text); see structured.py."""
        return response_format_schema(self.body.response_format)

    def stop_strings(self) -> list[str]:
        return self.body.stop_list()

    def token_counts(self, contexts: list[StreamContext]) -> tuple[int, int]:
        """Each prompt counts once however many choices it has (as OpenAI counts)."""
        return sum(c.prompt_tokens for c in contexts[:: self.body.n]), sum(c.completion_tokens for c in contexts)

    def usage(self, contexts: list[StreamContext]) -> dict:
        prompt, completion = self.token_counts(contexts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @property
    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    def format_stream_error(self, error: APIError) -> str:
        return sse_event(error_body(error, anthropic=False)) + DONE_FRAME

    def _chunk(self, choices: list[dict], usage: Optional[dict] = None) -> str:
        """One SSE frame of a stream; ``chunk_object`` names the protocol's object type."""
        chunk = {"id": self.resp_id, "object": self.chunk_object, "created": self.created,
                 "model": self.state.model_name, "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return sse_event(chunk)


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {"content": [{**_token_entry(e.text, e.logprob),
                         "top_logprobs": [_token_entry(t, lp) for _, t, lp in e.top]} for e in entries]}


def _message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for i, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise APIError("invalid_request", f"content part of type {part.type!r} is not supported; "
                           "this model reads text parts only", param=f"messages.content.{i}")
        texts.append(part.text)
    return "".join(texts)


class OpenAIHandler(_OpenAIBase):
    """``POST /v1/chat/completions``."""

    body: ChatCompletionRequest

    def create_response_id(self) -> str:
        return new_id("chatcmpl-")

    def requested_max_tokens(self) -> Optional[int]:
        return self.body.max_completion_tokens or self.body.max_tokens

    def logprob_settings(self) -> tuple[bool, int]:
        return self.body.logprobs, self.body.top_logprobs if self.body.logprobs else 0

    @property
    def tools_active(self) -> bool:
        return bool(self.body.tools) and self.body.tool_choice != "none"

    def output_schema(self) -> Optional[dict]:
        """A forced call ("required", or a named function) holds the reply to a call of the tools it allows."""
        choice, forced = self.body.tool_choice, None
        if choice == "required" or (choice is not None and not isinstance(choice, str)):
            tools = [(t.function.name, t.function.parameters) for t in self.body.tools or []]
            name = None if choice == "required" else choice.function.name
            forced = tool_call_schema(forced_tools(tools, name, "tool_choice"))
        return one_constraint(forced, super().output_schema())

    def build_prompt(self) -> list[list[int]]:
        messages = []
        for message in self.body.messages:
            role = "system" if message.role == "developer" else message.role
            text = _message_text(message)
            if message.tool_calls:
                calls = [render_tool_call(c.function.name, c.function.arguments) for c in message.tool_calls]
                text = "\n".join(([text] if text else []) + calls)
            messages.append({"role": role, "content": text})
        tools = [t.model_dump(exclude_none=True) for t in self.body.tools] if self.tools_active else None
        prompt = self.tokenize_chat(messages, tools)
        return [prompt] * self.body.n

    # ---- streaming ------------------------------------------------------------
    chunk_object = "chat.completion.chunk"

    def format_stream_start(self, contexts: list[StreamContext]) -> list[str]:
        self._parsers = [ToolCallStreamParser() if self.tools_active else None for _ in contexts]
        self._tool_counts = [0] * len(contexts)
        return [self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for c in contexts]

    def _pieces_to_frames(self, ctx: StreamContext, pieces, logprobs: list[TokenLogprob]) -> list[str]:
        frames = []
        for piece in pieces:
            if isinstance(piece, ParsedToolCall):
                call = {"index": self._tool_counts[ctx.index], "id": new_id("call_"), "type": "function",
                        "function": {"name": piece.name, "arguments": piece.arguments}}
                self._tool_counts[ctx.index] += 1
                delta = {"tool_calls": [call]}
            else:
                delta = {"content": piece}
            lp = chat_logprobs(logprobs) if logprobs and self.body.logprobs else None
            logprobs = []
            frames.append(self._chunk([{"index": ctx.index, "delta": delta, "logprobs": lp, "finish_reason": None}]))
        return frames

    def format_stream_token(self, ctx: StreamContext, delta: Delta) -> list[str]:
        parser = self._parsers[ctx.index]
        if not delta.finished:
            pieces = parser.feed(delta.text) if parser else ([delta.text] if delta.text else [])
            return self._pieces_to_frames(ctx, pieces, delta.logprobs)
        frames = self._pieces_to_frames(ctx, parser.finish(), []) if parser else []
        finish = "tool_calls" if self._tool_counts[ctx.index] else ctx.finish_reason
        frames.append(self._chunk([{"index": ctx.index, "delta": {}, "logprobs": None, "finish_reason": finish}]))
        return frames

    def format_stream_end(self, contexts: list[StreamContext]) -> list[str]:
        frames = [self._chunk([], self.usage(contexts))] if self.include_usage else []
        return frames + [DONE_FRAME]

    # ---- whole response -------------------------------------------------------
    def format_non_stream_response(self, contexts: list[StreamContext]) -> dict:
        choices = []
        for ctx in contexts:
            message: dict = {"role": "assistant", "content": ctx.accumulated}
            finish = ctx.finish_reason
            if self.tools_active:
                content, calls = parse_tool_calls(ctx.accumulated)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [
                        {"id": new_id("call_"), "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
                    finish = "tool_calls"
            choices.append({"index": ctx.index, "message": message,
                            "logprobs": chat_logprobs(ctx.logprobs) if self.body.logprobs else None,
                            "finish_reason": finish})
        return {"id": self.resp_id, "object": "chat.completion", "created": self.created,
                "model": self.state.model_name, "system_fingerprint": None, "choices": choices,
                "usage": self.usage(contexts)}


class OpenAICompletionHandler(_OpenAIBase):
    """``POST /v1/completions``: raw prompts, no chat template."""

    body: CompletionRequest
    _prompts: Optional[list[list[int]]] = None  # each distinct prompt's ids, once built
    _prompt_scores: tuple[list[TokenLogprob], ...] = ()  # their tokens' logprobs, when echo asks for them

    def create_response_id(self) -> str:
        return new_id("cmpl-")

    def logprob_settings(self) -> tuple[bool, int]:
        return self.body.logprobs is not None, self.body.logprobs or 0

    def _prompt_ids(self) -> list[list[int]]:
        prompt = self.body.prompt
        tokenizer = self.state.tokenizer
        if isinstance(prompt, str):  # the schema let through only these shapes, none of them empty
            prompts = [tokenizer.encode(prompt)]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [tokenizer.encode(p) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        vocab = getattr(tokenizer, "vocab_size", None)
        for i, ids in enumerate(prompts):
            if vocab is not None and any(t < 0 or t >= vocab for t in ids):
                raise APIError("invalid_request", f"prompt {i} has token ids outside [0, {vocab})", param="prompt")
        return prompts

    def build_prompt(self) -> list[list[int]]:
        if self._prompts is None:
            self._prompts = self._prompt_ids()
        return [p for p in self._prompts for _ in range(self.body.n)]

    @property
    def scores_prompt(self) -> bool:
        """``echo`` with ``logprobs``: the prompt's own tokens get log-probabilities too."""
        return self.body.echo and self.body.logprobs is not None

    async def handle(self) -> Response:
        score_only = self.body.max_tokens == 0
        if score_only and (not self.body.echo or self.body.stream):
            raise APIError("invalid_request", "max_tokens 0 only scores the prompt: it needs echo: true "
                           "(with logprobs for the scores) and stream: false", param="max_tokens")
        if not score_only:
            return await super().handle()
        self.logit_bias  # a key that is no token id is refused before anything runs
        self.check_model()
        prompts = self.build_prompt()
        self.state.check_fits_queue(len(self._prompts))
        await self.prepare_reply()
        contexts = [StreamContext(self.resp_id, self.state.model_name, index=i, created=self.created,
                                  prompt_tokens=len(p), finish_reason="length") for i, p in enumerate(prompts)]
        self._record(contexts, time.perf_counter(), finished=True)
        return JSONResponse(self.format_non_stream_response(contexts))

    async def prepare_reply(self) -> None:
        """Score the prompts when echo asks for their logprobs (after the engine took the
        generation requests, so a prompt it refuses is never scored)."""
        if self.scores_prompt:
            self._prompt_scores = tuple(await self.state.scorer.score_all(self._prompts, self.body.logprobs,
                                                                          self.state.queue_capacity))

    def _echo(self, ctx: StreamContext) -> str:
        if not self.body.echo:
            return ""
        return self.state.tokenizer.decode(self._prompts[ctx.index // self.body.n], skip_special_tokens=False)

    def _logprobs(self, entries: list[TokenLogprob], offsets: list[int]) -> Optional[dict]:
        if self.body.logprobs is None:
            return None
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t: lp for _, t, lp in e.top} for e in entries], "text_offset": offsets}

    def _generated_logprobs(self, entries: list[TokenLogprob], decoder, start: int) -> tuple[Optional[dict], int]:
        """Logprobs of generated tokens whose text starts at ``start``, and where their text ends;
        ``decoder`` (a stream decoder of the completion) carries on from the choice's earlier tokens."""
        if self.body.logprobs is None:
            return None, start
        offsets, end = text_offsets(decoder, [e.token_id for e in entries], start)
        return self._logprobs(entries, offsets), end

    def _echo_logprobs(self, ctx: StreamContext) -> Optional[dict]:
        """The prompt's tokens as logprobs: the first has no context, so its values are null (as in OpenAI)."""
        if not self.scores_prompt:
            return None
        prompt = self._prompts[ctx.index // self.body.n]
        tokenizer = self.state.tokenizer
        offsets, _ = text_offsets(tokenizer.stream_decoder(skip_special_tokens=False), prompt)
        scored = self._logprobs(self._prompt_scores[ctx.index // self.body.n], offsets[1:])
        return {"tokens": [token_text(tokenizer, prompt[0])] + scored["tokens"],
                "token_logprobs": [None] + scored["token_logprobs"],
                "top_logprobs": [None] + scored["top_logprobs"], "text_offset": offsets}

    def _choice_logprobs(self, ctx: StreamContext, start: int) -> Optional[dict]:
        generated, _ = self._generated_logprobs(ctx.logprobs, self.state.tokenizer.stream_decoder(), start)
        echoed = self._echo_logprobs(ctx)
        if echoed is None:
            return generated
        return {key: echoed[key] + generated[key] for key in echoed}

    chunk_object = "text_completion"

    def format_stream_start(self, contexts: list[StreamContext]) -> list[str]:
        self._decoders = [self.state.tokenizer.stream_decoder() for _ in contexts]
        self._positions = [0] * len(contexts)  # where each choice's next generated token's text starts
        frames = []
        for c in contexts:
            echo = self._echo(c)
            self._positions[c.index] = len(echo)
            if echo:
                frames.append(self._chunk([{"index": c.index, "text": echo, "logprobs": self._echo_logprobs(c),
                                            "finish_reason": None}]))
        return frames

    def format_stream_token(self, ctx: StreamContext, delta: Delta) -> list[str]:
        if delta.finished:
            return [self._chunk([{"index": ctx.index, "text": "", "logprobs": None,
                                  "finish_reason": ctx.finish_reason}])]
        lp, self._positions[ctx.index] = self._generated_logprobs(delta.logprobs, self._decoders[ctx.index],
                                                                  self._positions[ctx.index])
        return [self._chunk([{"index": ctx.index, "text": delta.text, "logprobs": lp, "finish_reason": None}])]

    def format_stream_end(self, contexts: list[StreamContext]) -> list[str]:
        frames = [self._chunk([], self.usage(contexts))] if self.include_usage else []
        return frames + [DONE_FRAME]

    def format_non_stream_response(self, contexts: list[StreamContext]) -> dict:
        choices = []
        for ctx in contexts:
            echo = self._echo(ctx)
            choices.append({"index": ctx.index, "text": echo + ctx.accumulated,
                            "logprobs": self._choice_logprobs(ctx, len(echo)), "finish_reason": ctx.finish_reason})
        return {"id": self.resp_id, "object": "text_completion", "created": self.created,
                "model": self.state.model_name, "system_fingerprint": None, "choices": choices,
                "usage": self.usage(contexts)}
