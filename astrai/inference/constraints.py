"""Constrained decoding: a request's output held to a JSON Schema, a regular expression or a grammar.

The language is compiled by llguidance, a maintained grammar engine made for this (Rust,
no dependencies of its own). Per request a matcher follows the output token by token;
before each draw it writes a bitmask of the tokens that keep the output a prefix of the
language, and the sampler sets every other logit to -inf, so whatever the model and the
sampling settings the output stays inside the language. When the language allows no
further token (a JSON value is closed) the request ends with finish_reason "stop".

llguidance won on both counts the choice was made on (SmolLM2's 49,152-token vocabulary,
one CPU core): a JSON Schema compiles in about 1 ms against outlines-core's 40-270 ms,
a mask costs about 25 µs a token, and a keyword it does not implement is an error that
names it, which becomes the request's error, never a silent fallback to free text.
xgrammar would bring transformers and triton with it.

Masks of a batch's constrained rows are written on a worker thread while the model runs
its step (llguidance releases the GIL) where a core is free for it, else after the step.
They stay packed, one bit per token: a greedy row only reads its argmax's bit.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import llguidance
import numpy as np
import torch

from astrai.errors import RequestError
from astrai.inference.sampling import NEG_INF, row_argmax
from astrai.inference.types import SamplingParams

CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar")
# Compact JSON unless a schema's "x-guidance" says otherwise: flexible whitespace lets a
# weak model spend its whole budget on spaces and newlines before the value closes.
JSON_DEFAULTS = {"whitespace_flexible": False}
BITS = 32  # llguidance's mask words are int32, one bit per token id
SHIFTS = torch.arange(BITS, dtype=torch.int32)


class _ByteVocabulary:
    """A tokenizer seen the way llguidance reads one: the bytes each token id stands for
    (a byte-level BPE token may hold part of a UTF-8 character), which ids are special (they
    never match grammar text), the end-of-sequence ids, and an encoder for text it forces."""

    def __init__(self, tokenizer, stop_ids: Sequence[int]):
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.eos_token_id = list(stop_ids)[0] if stop_ids else tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


_VOCABULARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_VOCABULARIES_LOCK = threading.Lock()


def grammar_vocabulary(tokenizer, stop_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer``, built once per tokenizer object (about 0.6 s for a
    49k vocabulary) and shared by every engine that serves it."""
    key = tuple(sorted(stop_ids))
    with _VOCABULARIES_LOCK:
        per_stops = _VOCABULARIES.setdefault(tokenizer, {})
        if key not in per_stops:
            wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer, key))
            per_stops[key] = llguidance.LLTokenizer(wrapper, eos_token=list(key) or None)
        return per_stops[key]


def grammar_of(params: SamplingParams) -> Optional[tuple[str, str]]:
    """(which field, llguidance grammar text) for the request's constraint, or None without one."""
    given = [name for name in CONSTRAINT_FIELDS if getattr(params, name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"give at most one of json_schema, regex and grammar; this request gives {' and '.join(given)}")
    name = given[0]
    value = getattr(params, name)
    if name == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise RequestError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise RequestError(f"json_schema must be a JSON object (a schema), got {type(value).__name__}")
        return name, llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty string, got {value!r}")
    if name == "regex":
        return name, llguidance.LLMatcher.grammar_from_regex(value)
    try:
        return name, llguidance.grammar_from("grammar", value)  # Lark, or llama.cpp's GBNF converted to it
    except ValueError as exc:
        raise RequestError(f"grammar is neither Lark nor GBNF that llguidance reads: {exc}") from None


class TokenConstraint:
    """One request's position in its language: which tokens may come next, and whether it is done."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_ids: Sequence[int], vocab_size: int):
        self.matcher = matcher
        self.stop_ids = list(stop_ids)
        self.vocab_size = vocab_size  # the tokenizer's, which the mask covers

    def consume(self, token_id: int) -> Optional[str]:
        """Advance past an accepted token; the reason when the token breaks the language (else None)."""
        if self.matcher.consume_token(token_id):
            return None
        return self.matcher.get_error() or f"token {token_id} is outside the constrained language"

    @property
    def finished(self) -> bool:
        """The language allows no further token (only the end of the sequence)."""
        return self.matcher.is_stopped()


class ConstraintCompiler:
    """Turns a request's json_schema / regex / grammar into a TokenConstraint for one engine."""

    def __init__(self, tokenizer, stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.stop_ids = sorted(stop_ids)

    def compile(self, params: SamplingParams) -> Optional[TokenConstraint]:
        """None for a free request; a RequestError naming what llguidance cannot handle."""
        found = grammar_of(params)
        if found is None:
            return None
        name, grammar = found
        if self.tokenizer is None:
            raise RequestError(f"{name} needs a tokenizer; this engine was built without one")
        vocabulary = grammar_vocabulary(self.tokenizer, self.stop_ids)
        matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the {name} cannot constrain generation: {matcher.get_error()}")
        return TokenConstraint(matcher, self.stop_ids, vocabulary.vocab_size)


@dataclass
class RowMasks:
    """The token masks of a batch's constrained rows, packed as llguidance writes them: row k
    of ``bits`` [len(rows), words] (int32) belongs to batch row ``rows[k]``, and token t may be
    drawn when bit t % 32 of word t // 32 is set (no id past the words, nor past the model's
    ``vocab_size``, ever is). They stay packed because a greedy row reads one bit of its mask,
    its argmax's; only a row whose argmax is forbidden, or one the full sampler draws from,
    unpacks its mask over the whole vocabulary."""

    rows: list[int]
    bits: torch.Tensor
    vocab_size: int

    @property
    def allowed(self) -> torch.Tensor:
        """Allowed tokens [len(rows), vocab_size], True = may be drawn."""
        return _unpack(self.bits, self.vocab_size)

    def apply_(self, logits: torch.Tensor) -> None:
        """Set every token a row's constraint forbids to -inf, in place in ``logits`` [B, V]."""
        forbidden = ~self.allowed.to(logits.device)
        for k, row in enumerate(self.rows):
            logits[row].masked_fill_(forbidden[k], NEG_INF)

    def take(self, rows: Sequence[int]) -> Optional["RowMasks"]:
        """The masks of batch rows ``rows`` alone, renumbered to their places in ``rows`` (None
        when none of them is constrained)."""
        place = {row: j for j, row in enumerate(rows)}
        kept = [k for k, row in enumerate(self.rows) if row in place]
        if not kept:
            return None
        return RowMasks([place[self.rows[k]] for k in kept], self.bits[kept], self.vocab_size)

    def hold_argmax(self, logits: torch.Tensor, ids: list[int], greedy: Sequence[int]) -> int:
        """Keep the greedy rows ``greedy`` inside their languages: where a row's argmax ``ids[row]``
        is a token its language forbids, ``ids[row]`` becomes the token of its largest allowed
        logit (the first of equals, as ``row_argmax`` over the masked row gives). Every other
        row is left as it is. Returns how many rows moved."""
        words = self.bits.numpy().view(np.uint32)
        among, moved = set(greedy), 0
        for k, row in enumerate(self.rows):
            if row not in among:
                continue
            word, bit = divmod(ids[row], BITS)
            if word < words.shape[1] and (int(words[k, word]) >> bit) & 1:
                continue
            forbidden = ~_unpack(self.bits[k:k + 1], self.vocab_size).to(logits.device)
            ids[row] = int(row_argmax(logits[row:row + 1].masked_fill(forbidden, NEG_INF)))
            moved += 1
        return moved


def _unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed masks [n, words] as booleans [n, vocab_size]; ids past the words are False."""
    allowed = ((bits.unsqueeze(-1) >> SHIFTS) & 1).view(bits.shape[0], -1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:  # the model's ids past the tokenizer's are never text
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed


def spare_core() -> bool:
    """Whether a core is left beside the model's threads. Where every core runs the model's
    matmuls, a mask thread beside them displaces one member of a team that waits at barriers:
    SmolLM2-135M on 2 cores and 2 threads lost 11-12% of its decode rate to overlapped masks
    and 1-5% to masks written after the step (bench/constrained.py)."""
    return torch.get_num_threads() < (os.cpu_count() or 1)


class MaskWriter:
    """Writes the masks of a batch's constrained rows, now or on its worker thread."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._pool: Optional[ThreadPoolExecutor] = None
        self._parallel: Optional[llguidance.LLExecutor] = None

    def start(self, constraints: Sequence[Optional[TokenConstraint]]) -> Optional[Future]:
        """Begin the masks of ``constraints`` (one per row, None for a free row) on the worker
        thread, to overlap the model's step, when a core is free for it; None (the sampler then
        writes them after the step) when every row is free or every core runs the model."""
        if all(c is None for c in constraints) or not spare_core():
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="astrai-masks")
        return self._pool.submit(self.compute, list(constraints))

    def compute(self, constraints: Sequence[Optional[TokenConstraint]]) -> Optional[RowMasks]:
        """The masks of the constrained rows, written now (None when every row is free)."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        if self._parallel is None:
            self._parallel = llguidance.LLExecutor()
        words = (constraints[rows[0]].vocab_size + BITS - 1) // BITS  # one tokenizer per engine
        bits = torch.zeros(len(rows), words, dtype=torch.int32)
        self._parallel.unsafe_compute_mask_ptr([(constraints[i].matcher, k) for k, i in enumerate(rows)],
                                               bits.data_ptr(), words * 4, len(rows))
        if self.vocab_size < words * BITS:  # bits past the model's vocabulary stand for no id
            whole, part = divmod(self.vocab_size, BITS)
            bits[:, whole + (part > 0):] = 0
            if part:
                bits[:, whole] &= (1 << part) - 1
        unsigned = bits.numpy().view(np.uint32)
        for k in (~bits.any(dim=-1)).nonzero().flatten().tolist():  # a matcher in error allows nothing: let the row end
            for stop in constraints[rows[k]].stop_ids:
                unsigned[k, stop // BITS] |= np.uint32(1 << (stop % BITS))
        return RowMasks(rows, bits, self.vocab_size)
