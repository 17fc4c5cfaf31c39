"""The Anthropic Messages protocol: ``POST /v1/messages``.

Streaming follows the documented event order: ``message_start``,
``content_block_start``, ``ping``, any number of ``content_block_delta``,
``content_block_stop``, ``message_delta`` (stop reason and output usage) and
``message_stop``. Stop reasons: ``end_turn`` (the model ended its turn),
``max_tokens`` and ``stop_sequence`` (with the sequence that matched).
"""

from __future__ import annotations

from astrai.inference.types import SamplingParams

from .errors import APIError, error_body
from .generation import Delta, StreamContext, new_id
from .protocol import ProtocolHandler
from .schemas import AnthropicContentBlock, MessagesRequest
from .sse import sse_event


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
        return [self.tokenize_chat(messages)]

    def sampling_params(self, choice: int) -> SamplingParams:
        b = self.body
        return SamplingParams(max_tokens=b.max_tokens, temperature=b.temperature, top_p=b.top_p, top_k=b.top_k,
                              seed=b.seed)

    def stop_strings(self) -> list[str]:
        return list(self.body.stop_sequences or [])

    def format_stream_start(self, contexts: list[StreamContext]) -> list[str]:
        ctx = contexts[0]
        message = {"id": self.resp_id, "type": "message", "role": "assistant", "content": [],
                   "model": self.state.model_name, "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": ctx.prompt_tokens, "output_tokens": 0}}
        return [
            sse_event({"type": "message_start", "message": message}, "message_start"),
            sse_event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                      "content_block_start"),
            sse_event({"type": "ping"}, "ping"),
        ]

    def format_stream_token(self, ctx: StreamContext, delta: Delta) -> list[str]:
        if delta.finished or not delta.text:
            return []
        return [sse_event({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": delta.text}}, "content_block_delta")]

    def format_stream_end(self, contexts: list[StreamContext]) -> list[str]:
        ctx = contexts[0]
        return [
            sse_event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse_event({"type": "message_delta",
                       "delta": {"stop_reason": stop_reason(ctx), "stop_sequence": ctx.stop_matched},
                       "usage": {"output_tokens": ctx.completion_tokens}}, "message_delta"),
            sse_event({"type": "message_stop"}, "message_stop"),
        ]

    def format_stream_error(self, error: APIError) -> str:
        return sse_event(error_body(error, anthropic=True), "error")

    def format_non_stream_response(self, contexts: list[StreamContext]) -> dict:
        ctx = contexts[0]
        return {"id": self.resp_id, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": [{"type": "text", "text": ctx.accumulated}],
                "stop_reason": stop_reason(ctx), "stop_sequence": ctx.stop_matched,
                "usage": {"input_tokens": ctx.prompt_tokens, "output_tokens": ctx.completion_tokens}}
