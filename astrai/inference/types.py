"""The engine's request/response vocabulary, shared by the engine, the CLI and the server.

``SamplingParams`` says how to sample one request; ``StreamEvent`` is what a request
handle yields as tokens arrive. The server maps both protocols (OpenAI, Anthropic)
onto these, so neither protocol leaks into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class SamplingParams:
    """Per-request sampling settings; every field may differ between requests in one batch.

    temperature 0 means greedy. top_k 0 and top_p 1.0 and min_p 0.0 mean "off".
    ``stop`` strings end generation and are not included in the returned text.
    ``seed`` makes sampling reproducible for this request regardless of batch mates.
    ``logit_bias`` adds a value in [-100, 100] to a token id's logit before anything else
    (OpenAI's definition: -100 bans a token, 100 all but forces it).
    At most one of ``json_schema`` (a dict or its JSON text), ``regex`` and ``grammar`` (Lark,
    or llama.cpp's GBNF) holds the output to a language (astrai/inference/constraints.py).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    json_schema: Union[dict[str, Any], str, None] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None


@dataclass
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class StreamEvent:
    """One step of a request's output.

    ``text`` is new, complete UTF-8 text (never half a character; stop strings are
    held back until they can be ruled out). ``finish_reason`` is set on the last
    event: "stop" (eos, stop id or stop string), "length" (max_tokens or context
    limit) or "abort" (removed by the caller, the client went away, the engine
    shut down, or - with ``error`` set - the step computing it failed).
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    matched_stop: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None


@dataclass
class GenerationRequest:
    """A chat request as one object (the spec's ``generate_with_request`` argument).

    ``messages`` are ``{"role": ..., "content": ...}`` dicts, rendered with the
    tokenizer's chat template plus the assistant generation prompt. Fields left None
    take the engine's defaults.
    """

    messages: list[dict] = field(default_factory=list)
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    temperature: Optional[float] = None
    max_tokens: Optional[int] = None
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None
