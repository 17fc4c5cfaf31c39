"""Log-probabilities of a prompt's own tokens, for ``echo`` with ``logprobs`` on ``/v1/completions``.

Evaluation harnesses score a multiple-choice answer or a text's perplexity by sending
context + continuation as the prompt and reading back how likely each prompt token
was. The engine's steps compute only the logits that sampling needs, so scoring asks the
engine for one plain forward over the whole prompt (``prompt_logits``), which it runs
between its steps and weight updates and hands back a chunk of positions at a time: the
memory a prompt takes is its hidden states plus one chunk's [positions, vocabulary]
logits, however long the prompt.

``PromptScorer`` runs that work on one worker thread of its own, one prompt at a time, so
a burst of scoring requests queues there instead of building logits side by side, and
counts the prompts waiting in it against the same ``--max-queue`` as generation.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from astrai.errors import RequestError
from astrai.inference.types import TokenLogprob

from .errors import APIError

SCORE_POSITIONS = 128  # prompt positions whose logits exist at once while scoring


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else ""


def text_offsets(decoder, token_ids: list[int], start: int = 0) -> tuple[list[int], int]:
    """Where each token's text begins in the text that ``token_ids`` decode to (plus ``start``),
    and where the text decoded so far ends.

    Counted from the pieces of a stream decoder, not from each token decoded alone: a token
    that ends inside a UTF-8 character (common in Chinese text and emoji) decodes alone to
    U+FFFD, and adding those lengths up would shift every later offset."""
    offsets, position = [], start
    for token in token_ids:
        offsets.append(position)
        position += len(decoder.push(token))
    return offsets, position


def score_prompt(engine, prompt_ids: list[int], n_top: int, positions: int = SCORE_POSITIONS) -> list[TokenLogprob]:
    """One entry per prompt token after the first (which has no context to be scored in).

    Each carries the token's log-probability given the tokens before it and the ``n_top``
    most likely tokens at that position, as a generated token's logprobs do."""
    targets = prompt_ids[1:]
    chosen: list[float] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []

    def consume(first: int, logits: torch.Tensor) -> None:
        rows = logits[:len(targets) - first]  # the last position predicts past the prompt
        if not len(rows):
            return
        logprobs = rows.float().log_softmax(dim=-1)
        wanted = torch.tensor(targets[first:first + len(rows)], device=logprobs.device)
        chosen.extend(logprobs.gather(1, wanted.unsqueeze(1)).squeeze(1).tolist())
        if n_top:
            values, ids = logprobs.topk(n_top, dim=-1)
            top_values.extend(values.tolist())
            top_ids.extend(ids.tolist())

    engine.prompt_logits(prompt_ids, consume, positions)
    tokenizer = engine.tokenizer
    entries = []
    for i, token in enumerate(targets):
        top = [(t, token_text(tokenizer, t), v) for t, v in zip(top_ids[i], top_values[i])] if n_top else []
        entries.append(TokenLogprob(token_id=token, text=token_text(tokenizer, token), logprob=chosen[i], top=top))
    return entries


class PromptScorer:
    """Scores prompts one at a time on its own worker thread, admitting no more than the queue holds."""

    def __init__(self, engine, positions: int = SCORE_POSITIONS):
        self.engine = engine
        self.positions = positions
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="astrai-scoring")
        self._lock = threading.Lock()
        self.waiting = 0  # prompts admitted and not yet scored

    def admit(self, prompts: int, capacity: Optional[int]) -> None:
        """Take ``prompts`` more, or answer 503 when they, the prompts already here and the
        engine's waiting requests would pass ``capacity`` (``--max-queue``)."""
        with self._lock:
            queued = self.engine.get_stats().get("queue_len", 0)
            if capacity is not None and self.waiting + queued + prompts > capacity:
                raise APIError("overloaded", f"the server is busy ({self.waiting} prompts waiting to be scored and "
                               f"{queued} requests queued, at most {capacity}); retry shortly")
            self.waiting += prompts

    def _done(self, prompts: int = 1) -> None:
        with self._lock:
            self.waiting -= prompts

    async def score_all(self, prompts: list[list[int]], n_top: int, capacity: Optional[int]) -> list[list[TokenLogprob]]:
        """Each prompt's entries (``score_prompt``), after checking every prompt against the
        engine's limits, so none is scored when any is refused."""
        for i, ids in enumerate(prompts):
            try:
                self.engine.check_prompt(ids, scoring=True)
            except RequestError as exc:
                raise APIError("invalid_request", f"prompt {i}: {exc}", param="prompt") from None
        self.admit(len(prompts), capacity)
        loop = asyncio.get_running_loop()
        scores = []
        try:
            for ids in prompts:
                scores.append(await loop.run_in_executor(self._worker, score_prompt, self.engine, ids, n_top,
                                                         self.positions))
                self._done()
        except RequestError as exc:  # the engine stopped meanwhile, or the like
            raise APIError("invalid_request", str(exc), param="prompt") from None
        finally:
            self._done(len(prompts) - len(scores))
        return scores

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
