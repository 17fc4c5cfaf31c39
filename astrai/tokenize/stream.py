"""Streaming detokenisation that never emits half a character.

A byte-level token can end in the middle of a multi-byte UTF-8 character, so
decoding tokens one by one would print replacement characters. The decoder
decodes the pending ids together with the ids of the previous release (which
start and end on character boundaries, and give decoders that treat a leading
space specially the context they need), and releases only the new text once it
no longer ends in an incomplete character. The pieces concatenate to the full
decode, and each push costs a decode of a few tokens, not of the whole stream.
"""

from __future__ import annotations

from typing import Callable

_INCOMPLETE = "\ufffd"


class StreamDecoder:
    """``push(token_id) -> str`` gives newly completed text; ``flush()`` the rest."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._context_ids: list[int] = []
        self._context_text = ""
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        self._pending.append(int(token_id))
        text = self._decode(self._context_ids + self._pending)
        if text.endswith(_INCOMPLETE):
            return ""
        return self._release(text)

    def flush(self) -> str:
        """Everything not yet emitted (an unfinished character becomes U+FFFD)."""
        if not self._pending:
            return ""
        return self._release(self._decode(self._context_ids + self._pending))

    def _release(self, text: str) -> str:
        new = text[len(self._context_text):]
        self._context_ids, self._pending = self._pending, []
        self._context_text = self._decode(self._context_ids)
        return new
