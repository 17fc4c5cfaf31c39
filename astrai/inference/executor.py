"""Executor: runs one step for its tasks through the model runner and samples their next tokens.

Each row is one task feeding its uncomputed tokens (a prefill chunk, or the last sampled
token when decoding). The executor turns tasks into the runner's plain rows, advances
each task's ``num_computed`` by what the step computed, and samples every row that has
reached the end of its context from the logits the runner returns. The token masks of
constrained rows (astrai/inference/constraints.py) are written while the model runs.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Iterable, Optional, Sequence

import torch

from astrai.inference.constraints import MaskWriter, RowMasks
from astrai.inference.runner import DraftRow, GreedyRun, ModelRunner, Row
from astrai.inference.sampling import SamplingPipeline, apply_penalties, draw, row_argmax
from astrai.inference.speculative import accept_greedy, accept_sampled
from astrai.inference.task import Task
from astrai.inference.types import TokenLogprob

# a temperature this small is greedy decoding (vLLM draws the same line): dividing by it would
# overflow float32 logits, or round to 0 and read as "no temperature"
GREEDY_BELOW = 1e-5

Sampled = tuple[int, Optional[TokenLogprob]]  # a token id and, when asked for, its log-probability entry


class Executor:
    def __init__(self, runner: ModelRunner, tokenizer=None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.generator = torch.Generator(device=runner.device)  # unseeded requests' draws (seeded ones bring their own)
        self.generator.seed()
        self.masks = MaskWriter(runner.model.config.vocab_size)
        # tokens ``sample`` chose, by the path that chose them: every key present, since readers copy it
        # from other threads (a lone greedy request's runs of steps choose theirs in the runner)
        self.sample_paths = dict.fromkeys(("argmax", "masked_argmax", "sampler"), 0)

    @property
    def model(self):
        return self.runner.model

    @property
    def page_cache(self):
        return self.runner.cache

    @torch.inference_mode()
    def forward(self, tasks: Sequence[Task], n_new: Sequence[int]) -> tuple[torch.Tensor, Optional[list[int]]]:
        """Feed ``n_new[i]`` uncomputed tokens of each task; return last-position logits [B, V]
        and each row's argmax when the runner found it on the way, else None."""
        rows = [Row(t.task_id, t.context[t.num_computed:t.num_computed + n], t.num_computed) for t, n in zip(tasks, n_new)]
        logits, argmax = self.runner.forward(rows)
        for t, n in zip(tasks, n_new):
            t.num_computed += n
        return logits, argmax

    def execute_prefill(self, tasks: Sequence[Task], n_new: Sequence[int]) -> list[Optional[Sampled]]:
        """Prefill chunks; tasks whose context is now fully computed get a sampled token (else None)."""
        done = [i for i, (t, n) in enumerate(zip(tasks, n_new)) if t.remaining == n]
        masks = self.masks.start([tasks[i].constraint for i in done])
        logits, argmax = self.forward(tasks, n_new)
        tokens: list[Optional[Sampled]] = [None] * len(tasks)
        if done:
            picked = self.sample([tasks[i] for i in done], logits[done], None if argmax is None else [argmax[i] for i in done],
                                 masks)
            for i, tok in zip(done, picked):
                tokens[i] = tok
        return tokens

    def execute_decode(self, tasks: Sequence[Task]) -> list[Sampled]:
        """One token for each task, the rows in the order the runner prefers; results in ``tasks`` order."""
        order = self.runner.decode_order([Row(t.task_id, [], t.num_computed) for t in tasks])
        ordered = [tasks[i] for i in order]
        masks = self.masks.start([t.constraint for t in ordered])
        sampled = self.sample(ordered, *self.forward(ordered, [1] * len(ordered)), masks)
        results: list[Sampled] = [None] * len(tasks)  # type: ignore[list-item]
        for i, token in zip(order, sampled):
            results[i] = token
        return results

    def runs_greedy_steps(self, task: Task) -> bool:
        """Whether ``task``'s decode steps may run several to one call (``execute_greedy_steps``):
        a greedy request without penalties, log-probabilities or a constraint, on a runner that takes such runs."""
        p = task.params
        return (self.runner.runs_greedy and p.temperature <= GREEDY_BELOW and not _has_penalty(p)
                and not p.logprobs and not p.top_logprobs and task.constraint is None)

    @torch.inference_mode()
    def execute_greedy_steps(self, task: Task, steps: int, stop_ids: Iterable[int],
                             max_seconds: float = float("inf")) -> list[Sampled]:
        """Up to ``steps`` tokens of a lone greedy task (``runs_greedy_steps``) from one run, fewer
        when one is in ``stop_ids`` or once the steps have taken ``max_seconds``; the task's pages
        must cover them. One token through the usual step when the runner cannot take the run."""
        row = Row(task.task_id, [task.context[task.num_computed]], task.num_computed)
        tokens = self.runner.greedy_run(GreedyRun(row, steps, tuple(sorted(stop_ids)), max_seconds))
        if tokens:
            task.num_computed += len(tokens)
            return [(token, None) for token in tokens]
        return self.execute_decode([task])

    @torch.inference_mode()
    def execute_speculative_run(self, task: Task, steps: int, stop_ids: Iterable[int], max_seconds: float, drafter,
                                hidden: Optional[torch.Tensor], drafting: DraftRow):
        """Up to ``steps`` tokens of a lone greedy task (``runs_greedy_steps``) from verify steps run
        in one call, drafting with ``drafter`` (the runner's ``speculative_run``); the task's pages
        must cover them. None when the runner cannot take the run."""
        row = Row(task.task_id, [task.context[task.num_computed]], task.num_computed)
        run = self.runner.speculative_run(GreedyRun(row, steps, tuple(sorted(stop_ids)), max_seconds), drafter, hidden,
                                          drafting)
        if run is not None:
            task.num_computed += len(run.tokens)
        return run

    def speculates(self, task: Task) -> bool:
        """Whether ``task``'s decode steps may check drafted tokens (``execute_verify``): a request
        without penalties, log-probabilities or a constraint, whose tokens the verify step's
        acceptance rules give exactly (astrai/inference/speculative.py)."""
        p = task.params
        return not _has_penalty(p) and not p.logprobs and not p.top_logprobs and task.constraint is None

    @torch.inference_mode()
    def execute_verify(self, tasks: Sequence[Task],
                       drafts: Sequence[Sequence[int]]) -> tuple[list[list[Sampled]], list[torch.Tensor]]:
        """One step feeding each task's last token followed by its drafted tokens (none for some
        rows); each task gets the tokens the acceptance rules keep (speculative.py), 1 to
        len(draft) + 1, and its ``num_computed`` covers its last token and the kept drafts. The
        cache past that holds rejected drafts, which the runner is told to forget (``rewind``).
        Also returns each task's final hidden state at its last computed position, the one whose
        logits chose its last new token (what a draft head drafts from)."""
        rows = [Row(t.task_id, [t.context[t.num_computed], *d], t.num_computed) for t, d in zip(tasks, drafts)]
        verified = self.runner.verify(rows)
        results, last_hidden = [], []
        for task, draft, (row_logits, row_hidden) in zip(tasks, drafts, verified):
            p = task.params
            if p.temperature <= GREEDY_BELOW:
                kept = accept_greedy(row_logits, draft)
            else:
                pipeline = SamplingPipeline.for_rows([p.temperature], [p.top_k], [p.top_p], [p.min_p],
                                                     row_logits.device)
                kept = accept_sampled(row_logits, draft, pipeline, task.generator, self.generator)
            task.num_computed += len(kept)  # the fed last token and the kept drafts; the final token is new
            self.runner.rewind(task.task_id, task.num_computed)
            results.append([(token, None) for token in kept])
            last_hidden.append(row_hidden[len(kept) - 1])
        return results, last_hidden

    @torch.inference_mode()
    def sample(self, tasks: Sequence[Task], logits: torch.Tensor, argmax: Optional[list[int]] = None,
               masks: Optional[Future] = None) -> list[Sampled]:
        """Next token (and its log-probability entry when asked) for each task's logits row;
        ``argmax``, when given, is each row's argmax, which greedy rows without penalties take.
        ``masks`` is the pending result of ``self.masks.start`` for these tasks (written now when
        not given); a constrained row draws only among the tokens its language allows next.

        A greedy row without penalties takes its argmax, and when constrained, the argmax among
        its allowed tokens (the plain one when its mask allows it, which is the same token); only
        the other rows (a temperature, a penalty or a bias) go through the full sampler."""
        logits = logits.float()
        params = [t.params for t in tasks]
        want_logprobs = any(p.logprobs or p.top_logprobs for p in params)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        allowed: Optional[RowMasks] = masks.result() if masks is not None else self.masks.compute(
            [t.constraint for t in tasks])
        greedy = [i for i, p in enumerate(params) if p.temperature <= GREEDY_BELOW and not _has_penalty(p)]
        full = sorted(set(range(len(tasks))) - set(greedy))
        ids = [0] * len(tasks)
        if greedy:
            ids = list(argmax) if argmax is not None else row_argmax(logits).tolist()
            moved = allowed.hold_argmax(logits, ids, greedy) if allowed is not None else 0
            self.sample_paths["argmax"] += len(greedy) - moved
            self.sample_paths["masked_argmax"] += moved
        if full:
            drawn = self._full_sampler([tasks[i] for i in full], logits[full],
                                       allowed.take(full) if allowed is not None else None)
            for i, token in zip(full, drawn):
                ids[i] = token
            self.sample_paths["sampler"] += len(full)
        if raw_logprobs is None:
            return [(tok, None) for tok in ids]
        return [(tok, self._logprob(raw_logprobs[i], tok, p.top_logprobs) if (p.logprobs or p.top_logprobs) else None)
                for i, (tok, p) in enumerate(zip(ids, params))]

    def _full_sampler(self, tasks: Sequence[Task], logits: torch.Tensor, allowed: Optional[RowMasks]) -> list[int]:
        """The tokens of rows with a temperature, a penalty or a bias: penalties and biases, then
        the language's mask, then each sampled row's filters and draw (a penalised greedy row
        takes the argmax). ``logits`` is the rows' own copy, changed in place."""
        params = [t.params for t in tasks]
        penalised = [i for i, p in enumerate(params) if _has_penalty(p)]
        for i in penalised:
            p = params[i]
            if p.logit_bias:
                biased = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                logits[i, biased] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                                  device=logits.device)
            apply_penalties(logits[i], tasks[i].context, tasks[i].output_ids, p.repetition_penalty,
                            p.frequency_penalty, p.presence_penalty)
        if penalised:  # an extreme penalty overflows a logit; keep every row finite before masking
            limit = torch.finfo(logits.dtype).max
            logits.nan_to_num_(nan=-limit, posinf=limit, neginf=-limit)
        if allowed is not None:  # after the penalties, so a forbidden token can never come back
            allowed.apply_(logits)
        ids = row_argmax(logits)
        sampled = [i for i, p in enumerate(params) if p.temperature > GREEDY_BELOW]
        if sampled:
            rows = logits[sampled]
            chosen = [params[i] for i in sampled]
            pipeline = SamplingPipeline.for_rows([p.temperature for p in chosen], [p.top_k for p in chosen],
                                                 [p.top_p for p in chosen], [p.min_p for p in chosen], rows.device)
            probs = pipeline.apply(rows).softmax(dim=-1)
            drawn = draw(probs, [tasks[i].generator for i in sampled], self.generator)
            if penalised:  # logits a penalty pushed to float32's limit leave no distribution: greedy then
                drawn = torch.where(probs.isfinite().all(dim=-1), drawn, ids[sampled])
            ids[sampled] = drawn
        return ids.tolist()

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
    """Whether ``p`` moves logits before the filters (a bias or a penalty), so its row needs the full sampler."""
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            or bool(p.logit_bias))
