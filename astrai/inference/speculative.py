"""Speculative decoding: draft a few tokens cheaply, check them all in one step of the model.

On a CPU a decode step's time is the reading of every weight, whether the step computes one
token or several; so a step that feeds a task's last token followed by k guessed ("drafted")
tokens costs little more than a plain step, and gives the model's own choice at each of the
k + 1 positions. The guesses the model agrees with are kept, plus the model's token at the
first disagreement (or after the last guess): 1 to k + 1 tokens for the price of about one
step. The output is exactly what decoding without drafts gives:

- a greedy row keeps drafted token i while it equals the argmax at position i;
- a sampled row keeps drafted token d with probability p(d), p being the row's filtered
  distribution (temperature, top-k, top-p, min-p) at that position, and on a rejection draws
  from p with d removed (renormalised). Drafts here are deterministic (a draft distribution
  q that is all on d), for which that is the standard rejection rule min(1, p/q) with the
  residual max(p - q, 0): every kept or drawn token has the target's own distribution
  (Leviathan et al. 2023; Chen et al. 2023).

Drafters (``Drafter``): ``PromptLookup`` finds the last few tokens earlier in the prompt or
output and proposes what followed them there (no second model: it pays when the answer
repeats the prompt, as in rewriting, extraction or code editing). ``DraftModel``, a smaller
model with the same tokenizer, lives in draft_model.py.

``SpeculationControl`` stops drafting for a row whose drafts the model keeps rejecting (each
rejected guess costs a little of the step) and tries again later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from astrai.inference.runner import DraftRow, LookupDrafts
from astrai.inference.sampling import SamplingPipeline, draw, row_argmax

SPECULATIVE_METHODS = ("ngram", "draft")
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 7  # a verify step feeds at most 8 tokens (the CPU kernels' row limit)
MAX_UNDRAFTED_RUN = 4  # greedy steps in one run for a row the drafter keeps finding nothing for


class Drafter(Protocol):
    """Proposes up to ``k`` tokens to follow each task's context (``[]`` when it has no guess).

    A drafter that drafts from the target's hidden state (head_drafter.py) also has
    ``observe(task, hidden)``, which the scheduler calls after each verify step,
    ``ready(task)``, false while it holds no current state for the task, and
    ``prepare(runner)``, which the scheduler calls once its runner is made. A drafter with state
    of its own per task (draft_model.py) may have ``catch_up(tasks)``, which the scheduler calls
    before ``propose`` and leaves out of the drafting time it weighs (a new request's prompt). A
    drafter whose drafts a runner can make itself between verify steps (prompt lookup; a head the
    runner fuses) has ``run_drafter(task)``: what the runner's ``speculative_run`` drafts with, or
    None."""

    def propose(self, tasks: Sequence, k: Sequence[int]) -> list[list[int]]: ...

    def forget(self, task_id: str) -> None: ...


@dataclass
class NgramIndex:
    """Where each n-gram of one context last began, for n in [min_n, max_n], kept up to date
    as the context grows (so a lookup costs O(max_n), not a scan of the context)."""

    min_n: int
    max_n: int
    seen: int = 0  # context tokens indexed so far
    last: dict = field(default_factory=dict)  # n-gram tuple → the position after its latest earlier occurrence

    def update(self, context: Sequence[int]) -> None:
        """Index the n-grams ending before the context's last ``max_n`` tokens' final one: an
        n-gram is recorded once a token follows it, so a lookup never finds the suffix itself."""
        for end in range(max(self.seen, self.min_n), len(context)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.last[tuple(context[end - n:end])] = end
        self.seen = max(self.seen, len(context))

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the context's last n tokens
        (longest n first), or []. An occurrence close to the end leaves fewer than ``k`` tokens
        after it; the draft then repeats them, as a loop of period len(context) - occurrence
        would continue."""
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            follow = self.last.get(tuple(context[len(context) - n:]))
            if follow is not None:
                period = len(context) - follow
                return [context[follow + i % period] for i in range(k)]
        return []


class PromptLookup:
    """Drafts by prompt lookup: the tokens that followed the latest earlier occurrence of the
    context's last ``max_n`` (down to ``min_n``) tokens, in the prompt or the output so far."""

    def __init__(self, min_n: int = 3, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, tasks: Sequence, k: Sequence[int]) -> list[list[int]]:
        drafts = []
        for task, wanted in zip(tasks, k):
            index = self._indexes.get(task.task_id)
            if index is None:
                index = self._indexes[task.task_id] = NgramIndex(self.min_n, self.max_n)
            index.update(task.context)
            drafts.append(index.lookup(task.context, wanted) if wanted > 0 else [])
        return drafts

    def run_drafter(self, task) -> LookupDrafts:
        """What a runner that runs several verify steps in one call drafts ``task``'s row with (the
        same lookup, made between the steps)."""
        return LookupDrafts(task.context, self.min_n, self.max_n)

    def forget(self, task_id: str) -> None:
        self._indexes.pop(task_id, None)


def accept_greedy(logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    """The tokens a greedy row keeps from a verify step: the drafted ones while each equals the
    argmax at its position, then the argmax at the first disagreement (or after the last draft).
    ``logits`` [len(draft) + 1, V], row i being the model's prediction after draft token i - 1."""
    choices = row_argmax(logits).tolist()
    kept = []
    for guess, choice in zip(draft, choices):
        if guess != choice:
            break
        kept.append(guess)
    kept.append(choices[len(kept)])
    return kept


def accept_sampled(logits: torch.Tensor, draft: Sequence[int], pipeline: SamplingPipeline,
                   generator: Optional[torch.Generator], shared: torch.Generator) -> list[int]:
    """The tokens a sampled row keeps from a verify step, by rejection sampling against its
    filtered distribution at each position (the module's docstring): the kept draft tokens,
    then one token drawn from the residual distribution at the first rejection, or from the
    distribution after the last draft when all are kept. ``pipeline`` holds the row's filters,
    one row's worth (it is applied to every position)."""
    probs = pipeline.apply(logits.float()).softmax(dim=-1)  # [len(draft) + 1, V]
    rng = generator if generator is not None else shared
    kept: list[int] = []
    for i, guess in enumerate(draft):
        p = probs[i]
        if float(torch.rand((), generator=rng)) < float(p[guess]):
            kept.append(guess)
            continue
        residual = p.clone()
        residual[guess] = 0.0
        if float(residual.sum()) <= 0.0:  # the draft held all the mass: a rejection cannot happen
            kept.append(guess)
            continue
        kept.append(int(draw(residual.unsqueeze(0), [generator], shared)[0]))
        return kept
    kept.append(int(draw(probs[len(draft)].unsqueeze(0), [generator], shared)[0]))
    return kept


@dataclass
class RowRecord:
    """One task's recent drafting: how long its drafts are, how often its guesses were kept, and
    how many steps it pauses."""

    length: int  # tokens to draft next step
    kept: float = 0.5  # moving average of the fraction of drafted tokens kept (from a neutral start)
    paused: int = 0  # decode steps to skip drafting
    pauses: int = 0  # pauses so far (each twice as long as the last)
    misses: int = 0  # steps since its last draft at which the drafter had none for it


@dataclass
class StepTimes:
    """Moving averages of one batch size's steps: seconds per plain decode token, and per verify
    step with the tokens each row got from it."""

    decode_s: Optional[float] = None
    verify_s: Optional[float] = None
    verify_tokens: float = 0.0
    verifies: int = 0  # verify steps averaged since the last pause
    since_plain: int = 0  # verify steps since the last plain one
    pause: int = 0  # decode steps left without drafting
    pauses: int = 0
    paused_by: frozenset = frozenset()  # the tasks of the batch whose verify steps began the pause


class SpeculationControl:
    """Which rows draft this step, and counts of what speculation did (``stats``).

    A row's draft length follows its drafts: twice as long (up to ``k``) after a step that kept
    every drafted token, one more than it kept after a step that did not. A run of agreement
    (a passage being copied) then drafts long, and the step after a disagreement, where the
    next guesses are seldom right, drafts short and costs little more than a plain step.

    Two switches, since a verify step costs more than a plain one (each drafted token is one
    more row of every matmul, which is arithmetic, not only reading):
    - per row: a row whose recent drafts were mostly rejected (kept fraction below
      ``min_kept``) pauses drafting for a while, longer each time; prompt lookup finds no
      guess at all where the output does not repeat, which costs nothing. The kept fraction is
      an average in which a step counts by the tokens it drafted (a missed one-token draft
      weighs a quarter of a missed four-token one at k = 4): short drafts after a miss cost
      little, and counted as whole steps two of them would pause a row;
    - per batch size: the measured tokens per second of verify steps (tokens each row got,
      over the step's time with its drafting) against plain decode steps of the same batch
      size; when drafting loses, the batch decodes plainly for a while (longer each time),
      then measures again (at once when the batch holds none of the tasks that earned the
      pause). A drafter with a guess every step (a draft model, a draft head)
      leaves no plain steps to weigh against, so after ``remeasure`` verify steps in a row
      the batch takes one plain step (for a lone greedy row, a run of greedy steps, what it
      would otherwise decode with): drafting that stops paying is then noticed, at the cost
      of one step in ``remeasure`` where it does pay.
    """

    def __init__(self, method: str, k: int, min_kept: float = 0.3, decay: float = 0.7, pause_steps: int = 8,
                 warmup: int = 3, remeasure: int = 32):
        self.method, self.k = method, k
        self.min_kept, self.decay, self.pause_steps, self.warmup = min_kept, decay, pause_steps, warmup
        self.remeasure = remeasure
        self._rows: dict[str, RowRecord] = {}
        self._times: dict[int, StepTimes] = {}
        self.verify_steps = self.drafted = self.accepted = self.rows_verified = self.tokens = 0
        self.paused_steps = self.plain_steps = 0
        self.stopped: Optional[str] = None  # the error that ended drafting for the engine's life, if one did

    def batch_wanted(self, rows: int, task_ids: Sequence[str] = ()) -> bool:
        """Whether a decode step of ``rows`` rows (the tasks ``task_ids``) drafts at all (see the
        class docstring). A pause ends early when none of the tasks that earned it is left in
        the batch (a lone request after another): what their drafts kept says little of the
        new ones', which are measured afresh."""
        times = self._times.setdefault(rows, StepTimes())
        if times.pause > 0 and task_ids and times.paused_by.isdisjoint(task_ids):
            times.pause = times.pauses = times.verifies = 0
        if times.pause > 0:
            times.pause -= 1
            self.paused_steps += 1
            return False
        if times.since_plain >= self.remeasure:
            times.since_plain = 0  # a plain step, timed for the comparison below
            self.plain_steps += 1
            return False
        if times.decode_s is None or times.verify_s is None or times.verifies < self.warmup:
            return True
        if times.verify_tokens * times.decode_s >= times.verify_s:
            return True
        times.pauses += 1
        times.pause = self.pause_steps * 2 ** min(times.pauses - 1, 4) - 1  # this step is the pause's first
        times.verifies = 0
        times.paused_by = frozenset(task_ids)
        self.paused_steps += 1
        return False

    def timed(self, kind: str, rows: int, seconds: float, tokens_per_row: float) -> None:
        """A step's wall time: ``kind`` "verify", or a plain "decode" step (or run of greedy steps)
        that gave each of its ``rows`` rows ``tokens_per_row`` tokens."""
        times = self._times.setdefault(rows, StepTimes())
        if kind == "verify":
            times.verify_s = _average(times.verify_s, seconds, self.decay)
            times.verify_tokens = _average(times.verify_tokens if times.verifies else None, tokens_per_row, self.decay)
            times.verifies += 1
            times.since_plain += 1
        elif tokens_per_row > 0:
            times.decode_s = _average(times.decode_s, seconds / tokens_per_row, self.decay)
            times.since_plain = 0

    def wanted(self, task, room: int) -> int:
        """Tokens to draft for ``task`` this step (0: decode it as usual); ``room`` is how many
        tokens past the next one it may still produce."""
        record = self._rows.setdefault(task.task_id, RowRecord(self.k))
        if record.paused > 0:
            record.paused -= 1
            return 0
        return max(0, min(record.length, room))

    def undrafted_steps(self, task_id: str) -> int:
        """Decode steps a lone greedy row takes in one run when the drafter found no draft for
        it: 1 after a draft, then 2, then ``MAX_UNDRAFTED_RUN`` while none comes. A run passes
        by the points where a draft could appear (prompt lookup's next match, a loop the output
        falls into), so it stays short; where the output has stopped repeating, a few steps per
        call save most of what a call costs beyond its step."""
        record = self._rows.setdefault(task_id, RowRecord(self.k))
        steps = min(1 << min(record.misses, 4), MAX_UNDRAFTED_RUN)
        record.misses += 1
        return steps

    def record(self, task_id: str, drafted: int, kept_drafts: int, produced: int) -> None:
        """A verify step's outcome for one row: ``kept_drafts`` of its ``drafted`` guesses kept,
        ``produced`` tokens in all (kept drafts plus the model's own)."""
        self.drafted += drafted
        self.accepted += kept_drafts
        self.tokens += produced
        self.rows_verified += 1
        if drafted == 0:
            return
        record = self._rows.setdefault(task_id, RowRecord(self.k))
        record.misses = 0
        record.length = min(self.k, 2 * drafted) if kept_drafts == drafted else kept_drafts + 1
        weight = self.decay ** (drafted / self.k)
        record.kept = weight * record.kept + (1 - weight) * kept_drafts / drafted
        if record.kept < self.min_kept:
            record.pauses += 1
            record.paused = self.pause_steps * 2 ** min(record.pauses - 1, 4)
            record.kept, record.length = 0.5, self.k  # it starts again as a new row would

    def draft_row(self, task_id: str) -> DraftRow:
        """``task_id``'s drafting for a runner that runs several verify steps in one call."""
        record = self._rows.setdefault(task_id, RowRecord(self.k))
        return DraftRow(record.length, record.kept, self.k, self.decay, self.min_kept)

    def ran(self, task_id: str, seconds: float, drafted: Sequence[int], kept_drafts: Sequence[int],
            produced: int) -> None:
        """A run of verify steps made in one call (``draft_row``'s runner), which gave ``produced``
        tokens in ``seconds``: each step is recorded and timed (at the run's mean) as the steps
        would have been one by one; a step for which the drafter had nothing is a plain step."""
        steps = len(drafted)
        given = 0
        for drafts, kept in zip(drafted, kept_drafts):
            tokens = min(kept + 1, produced - given)
            given += tokens
            self.timed("verify" if drafts else "decode", 1, seconds / steps, tokens)
            if drafts:
                self.record(task_id, drafts, kept, tokens)
                self.verify_steps += 1

    def forget(self, task_id: str) -> None:
        self._rows.pop(task_id, None)

    def stats(self) -> dict:
        return {"method": self.method, "draft_tokens": self.k, "verify_steps": self.verify_steps,
                "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_row_step": self.tokens / self.rows_verified if self.rows_verified else 0.0,
                "paused_steps": self.paused_steps, "plain_steps": self.plain_steps, "stopped": self.stopped}


def _average(old: Optional[float], new: float, decay: float) -> float:
    return new if old is None else decay * old + (1 - decay) * new
