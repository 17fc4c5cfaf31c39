"""The tool-call format: how a model asks for a function, and how the server reads it.

astrai's chat template lists the tools in a system turn and asks the model to reply
with a JSON object ``{"name": ..., "arguments": {...}}``. The server accepts two
spellings in the assistant's reply:

* ``<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>``
  anywhere in the text (any number of them; the text around them is the message
  content). Earlier tool calls in a conversation are rendered back in this form.
* a reply that consists only of one or more such JSON objects (what the template
  literally asks for).

``arguments`` is returned to clients as a JSON *string* (the OpenAI convention), always
re-serialised so ``json.loads`` on it succeeds. Text that looks like a call but is not
valid JSON stays ordinary content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Union

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, serialised


def render_tool_call(name: str, arguments: str) -> str:
    """A past call as the model would have written it (``arguments`` is a JSON string)."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        args = arguments
    return OPEN_TAG + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + CLOSE_TAG


def _as_call(obj) -> Optional[ParsedToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_json_calls(text: str) -> Optional[list[ParsedToolCall]]:
    """Calls if ``text`` is nothing but whitespace-separated JSON call objects, else None."""
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        call = _as_call(obj)
        if call is None:
            return None
        calls.append(call)


def parse_tool_calls(text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
    """Split a complete reply into (content or None, tool calls)."""
    bare = _parse_json_calls(text)
    if bare is not None:
        return None, bare
    parser = ToolCallStreamParser()
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, ParsedToolCall)]
    if not calls:
        return text, []
    return (content.strip() or None), calls


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ToolCallStreamParser:
    """Separates streamed text into content and tool calls as it arrives.

    Content is released at once unless it might be the start of a call: text from an
    opening tag to its closing tag is held and becomes one ``ParsedToolCall``; a reply
    that begins with ``{`` is held to the end and then judged as a whole.
    """

    def __init__(self):
        self._buffer = ""
        self._mode = "start"  # start -> text | json ; text <-> tag

    def feed(self, text: str) -> list[Union[str, ParsedToolCall]]:
        self._buffer += text
        out: list[Union[str, ParsedToolCall]] = []
        while True:
            if self._mode == "start":
                stripped = self._buffer.lstrip()
                if not stripped:
                    return out
                if stripped.startswith("{"):
                    self._mode = "json"
                elif OPEN_TAG.startswith(stripped[: len(OPEN_TAG)]) and len(stripped) < len(OPEN_TAG):
                    return out
                else:
                    self._mode = "text"
            if self._mode == "json":
                return out
            if self._mode == "text":
                at = self._buffer.find(OPEN_TAG)
                if at < 0:
                    keep = _partial_prefix_len(self._buffer, OPEN_TAG)
                    release = self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    if release:
                        out.append(release)
                    return out
                if at:
                    out.append(self._buffer[:at])
                self._buffer = self._buffer[at:]
                self._mode = "tag"
            if self._mode == "tag":
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    return out
                body = self._buffer[len(OPEN_TAG):end]
                call = _parse_json_calls(body)
                if call is not None and len(call) == 1:
                    out.append(call[0])
                else:
                    out.append(self._buffer[: end + len(CLOSE_TAG)])
                self._buffer = self._buffer[end + len(CLOSE_TAG):]
                self._mode = "text"

    def finish(self) -> list[Union[str, ParsedToolCall]]:
        """Everything still held, at the end of generation."""
        rest, self._buffer = self._buffer, ""
        if self._mode == "json":
            calls = _parse_json_calls(rest)
            if calls is not None:
                return list(calls)
        return [rest] if rest else []
