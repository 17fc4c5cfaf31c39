"""Checks on a request before it enters the queue, so bad input fails at once with a
clear ``RequestError`` instead of hanging or crashing the scheduler later."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from astrai.errors import RequestError
from astrai.inference.types import SamplingParams

MAX_TOP_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_prompt_len: int, max_seq_len: int) -> list[int]:
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise RequestError(f"prompt must be a list of token ids, got {type(prompt_ids).__name__}")
    ids = list(prompt_ids)
    if not ids:
        raise RequestError("prompt is empty; give at least one token")
    for i, tok in enumerate(ids):
        if not _is_int(tok) or not 0 <= tok < vocab_size:
            raise RequestError(f"prompt token {i} is {tok!r}; token ids must be integers in [0, {vocab_size})")
    if len(ids) > max_prompt_len:
        raise RequestError(f"prompt has {len(ids)} tokens, more than max_prompt_len={max_prompt_len}")
    if len(ids) >= max_seq_len:
        raise RequestError(f"prompt has {len(ids)} tokens, leaving no room to generate within max_seq_len={max_seq_len}")
    return ids


def check_params(params: SamplingParams, vocab_size: int, has_tokenizer: bool) -> None:
    p = params
    if not isinstance(p, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(p).__name__}")
    if not _is_int(p.max_tokens) or p.max_tokens <= 0:
        raise RequestError(f"max_tokens must be a positive integer, got {p.max_tokens!r}")
    if not _is_number(p.temperature) or p.temperature < 0:
        raise RequestError(f"temperature must be >= 0 (0 = greedy), got {p.temperature!r}")
    if not _is_number(p.top_p) or not 0 < p.top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p!r}")
    if not _is_int(p.top_k) or p.top_k < 0:
        raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {p.top_k!r}")
    if not _is_number(p.min_p) or not 0 <= p.min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1], got {p.min_p!r}")
    if not _is_number(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise RequestError(f"repetition_penalty must be > 0 (1 = off), got {p.repetition_penalty!r}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(p, name)
        if not _is_number(value) or not -2 <= value <= 2:
            raise RequestError(f"{name} must be in [-2, 2], got {value!r}")
    if not isinstance(p.logit_bias, dict):
        raise RequestError(f"logit_bias must map token ids to numbers, got {type(p.logit_bias).__name__}")
    for tok, bias in p.logit_bias.items():
        if not _is_int(tok) or not 0 <= tok < vocab_size:
            raise RequestError(f"logit_bias key {tok!r} is not a token id in [0, {vocab_size})")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise RequestError(f"logit_bias of token {tok} must be in [-100, 100], got {bias!r}")
    if p.seed is not None and not _is_int(p.seed):
        raise RequestError(f"seed must be an integer or None, got {p.seed!r}")
    if not _is_int(p.top_logprobs) or not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs!r}")
    if isinstance(p.stop, str):
        p.stop = [p.stop]
    if not isinstance(p.stop, (list, tuple)) or not all(isinstance(s, str) for s in p.stop):
        raise RequestError(f"stop must be a list of strings, got {p.stop!r}")
    if p.stop and not has_tokenizer:
        raise RequestError("stop strings need a tokenizer; this engine was built without one (use stop_token_ids)")
    for tok in p.stop_token_ids:
        if not _is_int(tok) or not 0 <= tok < vocab_size:
            raise RequestError(f"stop_token_ids entry {tok!r} is not a token id in [0, {vocab_size})")


def check_fits(prompt_len: int, params: SamplingParams, max_seq_len: int, page_size: int, num_pages: int,
               prompt_name: Optional[str] = None) -> None:
    """A request whose longest possible context exceeds the whole cache could never finish."""
    longest = min(prompt_len + params.max_tokens, max_seq_len)
    need = -(-longest // page_size)
    if need > num_pages:
        raise RequestError(f"{prompt_name or 'request'} may need {need} KV pages ({longest} tokens) but the cache has "
                           f"only {num_pages}; lower max_tokens or raise num_pages")
