"""The Anthropic Messages protocol: ``POST /v1/messages``.

Streaming follows the documented event order: ``message_start``,
``content_block_start``, ``ping``, any number of ``content_block_delta``,
``content_block_stop``, ``message_delta`` (stop reason and output usage) and
``message_stop``. Stop reasons: ``end_turn`` (the model ended its turn),
``max_tokens`` and ``stop_sequence`` (with the sequence that matched).

With ``tools`` the chat template lists them, and a call in the reply (the format of
toolcalls.py) comes back as a ``tool_use`` block with stop reason ``tool_use``;
``tool_choice`` ``{"type": "any"}`` or ``{"type": "tool", "name": ...}`` forces one, its
input valid against the tool's ``input_schema`` (structured.py). Without tools the reply
is one text block, opened at the start of a stream.
"""

from __future__ import annotations

import json
from typing import Optional

from astrai.inference.types import SamplingParams

from .errors import APIError, error_body
from .generation import Delta, StreamContext, new_id
from .protocol import ProtocolHandler
from .schemas import AnthropicContentBlock, MessagesRequest
from .sse import sse_event
from .structured import forced_tools, tool_call_schema
from .toolcalls import ParsedToolCall, ToolCallStreamParser, parse_tool_calls


def _blocks_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, AnthropicContentBlock) or block.type != "text" or block.text is None:
            kind = getattr(block, "type", type(block).__name__)
            raise APIError("invalid_request", f"{where}.{i}: content blocks of type {kind!r} are not supported; "
                           "this model reads text blocks only")
        texts.append(block.text)
    return "".join(texts)


def tool_use_block(call: ParsedToolCall) -> dict:
    return {"type": "tool_use", "id": new_id("toolu_"), "name": call.name, "input": json.loads(call.arguments)}


def stop_reason(ctx: StreamContext) -> str:
    if ctx.stop_matched is not None:
        return "stop_sequence"
    return "max_tokens" if ctx.finish_reason == "length" else "end_turn"


class AnthropicHandler(ProtocolHandler):
    """One ``/v1/messages`` request (always a single choice)."""

    body: MessagesRequest

    def create_response_id(self) -> str:
        return new_id("msg_")

    def build_prompt(self) -> list[list[int]]:
        messages = []
        if self.body.system:
            messages.append({"role": "system", "content": _blocks_text(self.body.system, "system")})
        for i, message in enumerate(self.body.messages):
            messages.append({"role": message.role, "content": _blocks_text(message.content, f"messages.{i}.content")})
        tools = None
        if self.tools_active:  # listed in the template the way the OpenAI protocol lists them
            tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                       **({"description": t.description} if t.description else {})}}
                     for t in self.body.tools]
        return [self.tokenize_chat(messages, tools)]

    @property
    def tools_active(self) -> bool:
        return bool(self.body.tools) and (self.body.tool_choice is None or self.body.tool_choice.type != "none")

    def output_schema(self) -> Optional[dict]:
        """``any`` or ``tool`` holds the reply to a call of the tools it allows (None: free text)."""
        choice = self.body.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return None
        tools = [(t.name, t.input_schema) for t in self.body.tools or []]
        return tool_call_schema(forced_tools(tools, choice.name if choice.type == "tool" else None, "tool_choice"))

    def sampling_params(self, choice: int) -> SamplingParams:
        b = self.body
        return SamplingParams(max_tokens=b.max_tokens, temperature=b.temperature, top_p=b.top_p, top_k=b.top_k,
                              seed=b.seed, json_schema=self.output_schema())

    def stop_strings(self) -> list[str]:
        return list(self.body.stop_sequences or [])

    def format_stream_start(self, contexts: list[StreamContext]) -> list[str]:
        ctx = contexts[0]
        message = {"id": self.resp_id, "type": "message", "role": "assistant", "content": [],
                   "model": self.state.model_name, "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": ctx.prompt_tokens, "output_tokens": 0}}
        self._parser = ToolCallStreamParser() if self.tools_active else None
        self._blocks, self._text_open, self._called = 0, False, False
        frames = [sse_event({"type": "message_start", "message": message}, "message_start")]
        if self._parser is None:
            frames += self._open_text()
        return frames + [sse_event({"type": "ping"}, "ping")]

    def _open_text(self) -> list[str]:
        self._blocks, self._text_open = self._blocks + 1, True
        return [sse_event({"type": "content_block_start", "index": self._blocks - 1,
                           "content_block": {"type": "text", "text": ""}}, "content_block_start")]

    def _close_text(self) -> list[str]:
        if not self._text_open:
            return []
        self._text_open = False
        return [sse_event({"type": "content_block_stop", "index": self._blocks - 1}, "content_block_stop")]

    def _text_frames(self, text: str) -> list[str]:
        frames = [] if self._text_open else self._open_text()
        return frames + [sse_event({"type": "content_block_delta", "index": self._blocks - 1,
                                    "delta": {"type": "text_delta", "text": text}}, "content_block_delta")]

    def _tool_use_frames(self, call: ParsedToolCall) -> list[str]:
        """A whole call as one block: its start, its input as a single JSON delta, its stop."""
        frames = self._close_text()
        block = tool_use_block(call)
        index, self._blocks, self._called = self._blocks, self._blocks + 1, True
        return frames + [
            sse_event({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                      "content_block_start"),
            sse_event({"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": call.arguments}}, "content_block_delta"),
            sse_event({"type": "content_block_stop", "index": index}, "content_block_stop"),
        ]

    def format_stream_token(self, ctx: StreamContext, delta: Delta) -> list[str]:
        if self._parser is None:
            return self._text_frames(delta.text) if delta.text and not delta.finished else []
        pieces = self._parser.finish() if delta.finished else self._parser.feed(delta.text)
        frames = []
        for piece in pieces:
            if isinstance(piece, ParsedToolCall):
                frames += self._tool_use_frames(piece)
            elif piece:
                frames += self._text_frames(piece)
        return frames

    def format_stream_end(self, contexts: list[StreamContext]) -> list[str]:
        ctx = contexts[0]
        return self._close_text() + [
            sse_event({"type": "message_delta",
                       "delta": {"stop_reason": "tool_use" if self._called else stop_reason(ctx),
                                 "stop_sequence": ctx.stop_matched},
                       "usage": {"output_tokens": ctx.completion_tokens}}, "message_delta"),
            sse_event({"type": "message_stop"}, "message_stop"),
        ]

    def format_stream_error(self, error: APIError) -> str:
        return sse_event(error_body(error, anthropic=True), "error")

    def format_non_stream_response(self, contexts: list[StreamContext]) -> dict:
        ctx = contexts[0]
        content, reason = [{"type": "text", "text": ctx.accumulated}], stop_reason(ctx)
        if self.tools_active:
            text, calls = parse_tool_calls(ctx.accumulated)
            if calls:
                content = ([{"type": "text", "text": text}] if text else []) + [tool_use_block(c) for c in calls]
                reason = "tool_use"
        return {"id": self.resp_id, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": ctx.stop_matched,
                "usage": {"input_tokens": ctx.prompt_tokens, "output_tokens": ctx.completion_tokens}}
