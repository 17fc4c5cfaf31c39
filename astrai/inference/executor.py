"""Executor: runs one forward for all tasks of a step and samples their next tokens.

Each row is one task feeding its uncomputed tokens (a prefill chunk, or the last
sampled token when decoding), padded to the longest row. Positions come from the
cache view (absolute positions, so cached prefixes and preempted tasks line up), and
``logits_index`` asks the model for each row's last real position only, so the
vocabulary projection (and the last block's output projection and feed-forward) costs
one row per task. A GQA model on CPU whose prefill step
has rows of different lengths gets them packed instead: one row of every task's
chunk after the other, no padding, with attention run per task (see KvcacheView).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from astrai.inference.cache import KVCache
from astrai.inference.fused_decode import FusedDecode
from astrai.inference.sampling import SamplingPipeline, apply_penalties, draw, row_argmax
from astrai.inference.task import Task
from astrai.inference.types import TokenLogprob

Sampled = tuple[int, Optional[TokenLogprob]]  # a token id and, when asked for, its log-probability entry


class Executor:
    def __init__(self, model, page_cache: KVCache, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer
        self.page_cache = page_cache
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)  # unseeded requests' draws (seeded ones bring their own)
        self.generator.seed()
        config = getattr(model, "config", None)
        # the attention that reads the view's row_spans; on CPU, where SDPA's causal kernel
        # per row beat the masked kernel over padded rows
        self.packs_prefill = getattr(config, "attn_type", None) == "gqa" and self.device.type == "cpu"
        # a single request's decode step in one C call when the model fits (fused_decode.py)
        self.fused_decode = FusedDecode.for_model(model) if self.device.type == "cpu" else None

    @torch.inference_mode()
    def forward(self, tasks: Sequence[Task], n_new: Sequence[int]) -> tuple[torch.Tensor, Optional[list[int]]]:
        """Feed ``n_new[i]`` uncomputed tokens of each task; return last-position logits [B, V]
        and each row's argmax when the step found it with them (the fused one-row step does, in
        the head's product), else None."""
        fused = self._fused_logits(tasks, n_new) if self.fused_decode is not None else None
        if fused is not None:
            logits, argmax = fused[0], [fused[1]]
        else:
            starts = [t.num_computed for t in tasks]
            ids = [t.task_id for t in tasks]
            table = self.page_cache.make_table_tensor(ids, self.device, n_tokens=max(s + n for s, n in zip(starts, n_new)))
            view = self.page_cache.bind(table, starts, n_new, task_ids=ids, packed=self.packs_prefill)
            logits = self._model_logits(view, [t.context[s:s + n] for t, s, n in zip(tasks, starts, n_new)], n_new)
            argmax = None
        for t, n in zip(tasks, n_new):
            t.num_computed += n
        return logits, argmax

    def _fused_logits(self, tasks: Sequence[Task], n_new: Sequence[int]) -> Optional[tuple[torch.Tensor, int]]:
        """A single request's decode step through the C step (fused_decode.py): its logits [1, V]
        and their argmax, or None when it does not qualify."""
        if len(tasks) != 1 or n_new[0] != 1 or not self.fused_decode.ready():
            return None
        task = tasks[0]
        target = self.page_cache.decode_target(task.task_id, task.num_computed)
        return None if target is None else self.fused_decode(task.context[task.num_computed], target)

    def _model_logits(self, view, chunks: list[list[int]], n_new: Sequence[int]) -> torch.Tensor:
        """The model's forward over the step's new tokens; each row's last position's logits [B, V]."""
        if view.packed:
            input_ids = torch.tensor([[token for chunk in chunks for token in chunk]], device=self.device)
            ends = torch.tensor(n_new, device=self.device).cumsum(0) - 1
            out = self.model(input_ids, paged_cache=view, position_ids=view.position_ids, logits_index=ends.view(1, -1))
            return out["logits"][0]
        T = max(n_new)
        input_ids = torch.tensor([chunk + [0] * (T - len(chunk)) for chunk in chunks], device=self.device)
        logits_index = None if T == 1 else torch.tensor([n - 1 for n in n_new], device=self.device)
        out = self.model(input_ids, paged_cache=view, position_ids=view.position_ids, logits_index=logits_index)
        return out["logits"][:, -1]

    def execute_prefill(self, tasks: Sequence[Task], n_new: Sequence[int]) -> list[Optional[Sampled]]:
        """Prefill chunks; tasks whose context is now fully computed get a sampled token (else None)."""
        logits, argmax = self.forward(tasks, n_new)
        done = [i for i, t in enumerate(tasks) if t.remaining == 0]
        tokens: list[Optional[Sampled]] = [None] * len(tasks)
        if done:
            picked = self.sample([tasks[i] for i in done], logits[done], None if argmax is None else [argmax[i] for i in done])
            for i, tok in zip(done, picked):
                tokens[i] = tok
        return tokens

    def execute_decode(self, tasks: Sequence[Task]) -> list[Sampled]:
        """One token for each task; rows ordered as the cache's decode buffers hold them, so a
        changed batch costs a few row copies instead of a re-gather. Results are in ``tasks`` order."""
        order = self.page_cache.decode_order([t.task_id for t in tasks], [t.num_computed for t in tasks])
        ordered = [tasks[i] for i in order]
        sampled = self.sample(ordered, *self.forward(ordered, [1] * len(ordered)))
        results: list[Sampled] = [None] * len(tasks)  # type: ignore[list-item]
        for i, token in zip(order, sampled):
            results[i] = token
        return results

    def runs_greedy_steps(self, task: Task) -> bool:
        """Whether ``task``'s decode steps may run several to one call (``execute_greedy_steps``):
        a greedy request without penalties or log-probabilities, on a model the fused step serves."""
        p = task.params
        return (self.fused_decode is not None and p.temperature == 0 and not _has_penalty(p)
                and not p.logprobs and not p.top_logprobs)

    @torch.inference_mode()
    def execute_greedy_steps(self, task: Task, steps: int, stop_ids: Iterable[int],
                             max_seconds: float = float("inf")) -> list[Sampled]:
        """Up to ``steps`` tokens of a lone greedy task (``runs_greedy_steps``) from one call into
        the fused step, fewer when one is in ``stop_ids`` or once the steps have taken
        ``max_seconds``; the task's pages must cover them (``KVCache.task_extend``). One token
        through the usual step when the call does not qualify."""
        if self.fused_decode.ready():
            target = self.page_cache.decode_target(task.task_id, task.num_computed, steps)
            if target is not None:
                tokens = self.fused_decode.greedy_steps(task.context[task.num_computed], target, sorted(stop_ids),
                                                        max_seconds)
                if tokens:
                    task.num_computed += len(tokens)
                    return [(token, None) for token in tokens]
        return self.execute_decode([task])

    @torch.inference_mode()
    def sample(self, tasks: Sequence[Task], logits: torch.Tensor, argmax: Optional[list[int]] = None) -> list[Sampled]:
        """Next token (and its log-probability entry when asked) for each task's logits row;
        ``argmax``, when given, is each row's argmax, which greedy rows without penalties take."""
        logits = logits.float()
        params = [t.params for t in tasks]
        want_logprobs = any(p.logprobs or p.top_logprobs for p in params)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        if all(p.temperature == 0 for p in params) and not any(_has_penalty(p) for p in params):
            ids = argmax if argmax is not None else row_argmax(logits).tolist()
        else:
            logits = logits.clone()
            for i, (t, p) in enumerate(zip(tasks, params)):
                if _has_penalty(p):
                    apply_penalties(logits[i], t.context, t.output_ids, p.repetition_penalty,
                                    p.frequency_penalty, p.presence_penalty)
            ids = row_argmax(logits)
            sampled = [i for i, p in enumerate(params) if p.temperature > 0]
            if sampled:
                rows = logits[sampled]
                chosen = [params[i] for i in sampled]
                pipeline = SamplingPipeline.for_rows([p.temperature for p in chosen], [p.top_k for p in chosen],
                                                     [p.top_p for p in chosen], [p.min_p for p in chosen], rows.device)
                probs = pipeline.apply(rows).softmax(dim=-1)
                ids[sampled] = draw(probs, [tasks[i].generator for i in sampled], self.generator)
            ids = ids.tolist()
        if raw_logprobs is None:
            return [(tok, None) for tok in ids]
        return [(tok, self._logprob(raw_logprobs[i], tok, p.top_logprobs) if (p.logprobs or p.top_logprobs) else None)
                for i, (tok, p) in enumerate(zip(ids, params))]

    def _logprob(self, row: torch.Tensor, token: int, n_top: int) -> TokenLogprob:
        top = []
        if n_top:
            values, indices = row.topk(n_top)
            top = [(i, self._text(i), v) for i, v in zip(indices.tolist(), values.tolist())]
        return TokenLogprob(token_id=token, text=self._text(token), logprob=float(row[token]), top=top)

    def _text(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token], skip_special_tokens=False)


def _has_penalty(p) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
