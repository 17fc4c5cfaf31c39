"""Structured outputs on the wire, turned into the JSON Schema the engine holds a reply to.

* OpenAI's ``response_format``: ``{"type": "json_object"}`` asks for a JSON object,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": ..., "strict": ...}}`` for
  one that validates against the schema (what ``client.chat.completions.parse`` sends for a
  Pydantic model). The output is held to the schema whatever ``strict`` says.
* A forced tool call: OpenAI's ``tool_choice`` ``"required"`` or a named function, Anthropic's
  ``{"type": "any"}`` or ``{"type": "tool", "name": ...}``. The reply is then the call object
  the chat template asks for (astrai/serving/toolcalls.py), ``{"name": ...,
  "arguments": {...}}``, its name one of the allowed tools and its arguments valid against
  that tool's parameters.

Both become ``SamplingParams.json_schema``; the engine compiles it (astrai/inference/constraints.py),
and a schema it cannot compile is the request's 400, naming what it could not handle.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .errors import APIError

ANY_OBJECT: dict[str, Any] = {"type": "object"}
ANY_JSON: dict[str, Any] = {}


def response_format_schema(response_format) -> Optional[dict]:
    """The schema an OpenAI ``response_format`` asks for (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ANY_OBJECT
    schema = response_format.json_schema.schema_
    return ANY_JSON if schema is None else schema


def tool_call_schema(tools: Sequence[tuple[str, Optional[dict]]]) -> dict:
    """A call object of one of ``tools`` ((name, parameters schema) pairs): its name fixed to the
    tool's, its arguments held to the tool's parameters (any object when it gives none)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": name}, "arguments": ANY_OBJECT if parameters is None else parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for name, parameters in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def forced_tools(tools: Sequence[tuple[str, Optional[dict]]], name: Optional[str], param: str) -> list:
    """The tools a forced call may name: all of them, or the one ``name`` picks (a 400 if absent)."""
    if not tools:
        raise APIError("invalid_request", "tool_choice forces a tool call, but the request lists no tools",
                       param=param)
    if name is None:
        return list(tools)
    chosen = [t for t in tools if t[0] == name]
    if not chosen:
        raise APIError("invalid_request", f"tool_choice names {name!r}, which is not among the request's tools "
                       f"({', '.join(t[0] for t in tools)})", param=param)
    return chosen


def one_constraint(forced_call: Optional[dict], response_format: Optional[dict]) -> Optional[dict]:
    """The reply's schema: a forced call or a response format, never both at once."""
    if forced_call is not None and response_format is not None:
        raise APIError("invalid_request", "tool_choice forces a tool call, so response_format cannot also "
                       "shape the reply; send one of them", param="response_format")
    return forced_call if forced_call is not None else response_format
