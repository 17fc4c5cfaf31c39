"""DraftModel: a smaller model with the target's tokenizer, drafting for speculative decoding.

The draft model runs greedily in its own paged KV cache, one row per task, under the
same task ids as the target's cache. Each draft first brings the draft cache up to the
task's context (the tokens the target kept since the last draft: one to a few), then takes
``k`` greedy steps; on the CPU backend the catch-up is one fused verify call and the
steps one fused greedy run, so a draft costs about ``k`` of the draft model's decode steps.
What the draft cache holds past the context (its guesses the target rejected) is
overwritten by the next catch-up. A task's first draft would begin with its whole prompt;
``catch_up`` prefills that beforehand, where the scheduler keeps it out of the drafting time
it weighs against plain decoding (a prompt's prefill is paid once, not at every step).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from astrai.errors import RequestError
from astrai.inference.cache import KVCache
from astrai.inference.runner import GreedyRun, ModelRunner, Row
from astrai.inference.scheduler import create_runner, default_num_pages

CATCH_UP_VERIFY = 8  # catch-ups of at most this many tokens take the runner's verify step (one fused call)


class DraftModel:
    """Greedy drafts from ``model`` (see the module's docstring). ``max_seq_len`` and
    ``max_batch_size`` size its cache as the target's are sized."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_seq_len: int, max_batch_size: int,
                 page_size: int = 16, in_place: bool = False):
        if model.config.vocab_size != vocab_size:
            raise RequestError(f"the draft model's vocabulary has {model.config.vocab_size} tokens, the target's "
                               f"{vocab_size}: a draft model must share the target's tokenizer")
        if model.config.max_len < max_seq_len:
            raise RequestError(f"the draft model holds {model.config.max_len} positions, fewer than the engine's "
                               f"max_seq_len {max_seq_len}: lower --max-seq-len or pick another draft model")
        probe = KVCache.for_model(model, num_pages=1, page_size=page_size, prefix_cache=False)
        num_pages = default_num_pages(probe.storage.bytes_per_token(), max_batch_size, max_seq_len + 8, page_size)
        self.cache = KVCache.for_model(model, num_pages=num_pages, page_size=page_size, prefix_cache=False)
        self.runner: ModelRunner = create_runner(model, self.cache, in_place)
        # per task: the context's length at its last draft and the guesses fed after it: the draft
        # cache holds K/V for context[:length] + fed (a task's context only grows)
        self._held: dict[str, tuple[int, list[int]]] = {}

    @torch.inference_mode()
    def propose(self, tasks: Sequence, k: Sequence[int]) -> list[list[int]]:
        return [self._draft(task.task_id, task.context, wanted) if wanted > 0 else [] for task, wanted in zip(tasks, k)]

    @torch.inference_mode()
    def catch_up(self, tasks: Sequence) -> None:
        """Prefill the draft cache with all but the last token of the context of each task it
        holds nothing for yet (the last one is fed by the task's first draft)."""
        for task in tasks:
            context = task.context
            if task.task_id in self._held or len(context) - 1 <= CATCH_UP_VERIFY:
                continue
            if not self.cache.task_alloc(task.task_id, context):
                continue  # no pages now: the first draft tries again
            if not self.cache.task_extend(task.task_id, len(context)):
                self.cache.task_free(task.task_id)
                continue
            self.runner.forward([Row(task.task_id, context[:-1], 0)])
            self._held[task.task_id] = (len(context) - 1, [])

    def forget(self, task_id: str) -> None:
        self.cache.task_free(task_id)
        self._held.pop(task_id, None)

    def _draft(self, task_id: str, context: list[int], k: int) -> list[int]:
        held = self._held.get(task_id)
        if held is None:
            if not self.cache.task_alloc(task_id, context):
                return []
            common = 0
        else:
            length, fed = held
            common = length + _common_prefix(fed, context[length:length + len(fed)])
        common = min(common, len(context) - 1)  # at least the last token is fed: its logits give the first guess
        if not self.cache.task_extend(task_id, len(context) + k):
            if held is None:  # let go of the pages just taken: the next draft starts over
                self.cache.task_free(task_id)
            return []
        self.runner.rewind(task_id, common)
        chunk = Row(task_id, context[common:], common)
        if len(chunk.tokens) <= CATCH_UP_VERIFY:
            token = int(self.runner.verify([chunk])[0][0][-1].argmax())
        else:
            logits, argmax = self.runner.forward([chunk])
            token = argmax[0] if argmax is not None else int(logits[0].argmax())
        draft = [token]
        if k > 1:
            draft += self._greedy(task_id, token, len(context), k - 1)
        self._held[task_id] = (len(context), draft[:-1])
        return draft

    def _greedy(self, task_id: str, token: int, pos: int, steps: int) -> list[int]:
        """``steps`` greedy tokens after ``token`` at ``pos``: one run when the runner takes runs."""
        tokens = self.runner.greedy_run(GreedyRun(Row(task_id, [token], pos), steps, (), float("inf")))
        if tokens is not None:
            return tokens
        tokens = []
        for i in range(steps):
            logits, argmax = self.runner.forward([Row(task_id, [token], pos + i)])
            token = argmax[0] if argmax is not None else int(logits[0].argmax())
            tokens.append(token)
        return tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
