"""ModelRunner: the model's side of a step - prepare a model for serving, run a step's forward.

The scheduler decides which tasks run and how many tokens each feeds; the executor hands
the runner those rows as plain data (``Row``) and samples from the logits it returns. The
runner owns the model it serves: by default a copy of the one it was given, so that
whatever a backend does to prepare it (re-laid weights, swapped modules) never reaches the
caller's object; ``in_place=True`` is the caller's consent to prepare that object itself.

This is the device-neutral runner: the plain ``KvcacheView`` (SDPA over the page table)
for every step. A device's backend (astrai/backends, found by the device's kind) may register
a subclass that adds its own kernels behind the same calls (the CPU's:
astrai/backends/cpu/runner.py); ``create_runner`` in scheduler.py builds the one registered.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from astrai.backends import PLAIN_DECODE_PATH, backend_for
from astrai.inference.cache import KVCache


@dataclass(frozen=True)
class Row:
    """One task's part of a step: its id (the cache's key), the tokens it feeds and the
    position of the first of them (the tokens before it are in the cache)."""

    task_id: str
    tokens: list[int]
    start: int


@dataclass(frozen=True)
class GreedyRun:
    """Up to ``steps`` greedy decode steps of one row, each feeding the last one's argmax; the
    run ends early after a token in ``stop_ids`` or once it has taken ``max_seconds``."""

    row: Row
    steps: int
    stop_ids: tuple[int, ...]
    max_seconds: float


@dataclass(frozen=True)
class LookupDrafts:
    """Prompt lookup's drafting of one row for ``speculative_run``: the row's tokens (its last
    token last) and the n-gram sizes looked up (speculative.py's PromptLookup)."""

    context: list[int]
    min_n: int
    max_n: int


@dataclass(frozen=True)
class DraftRow:
    """A row's drafting as speculative.py's SpeculationControl keeps it, for a runner that runs
    several verify steps in one call (``speculative_run``): tokens to draft next (``length``), the
    moving average of the fraction of drafts kept (``kept``), and the control's k, decay and floor."""

    length: int
    kept: float
    max_draft: int
    decay: float
    min_kept: float


class ModelRunner:
    """Runs a step's forward over the paged cache with the model's own modules.

    It counts its decode steps by the path that ran them (``decode_path_counts``), under the
    names its device's backend lists (``Backend.decode_paths``): "torch" is the model's forward
    with plain torch ops, this runner's every step; a backend's runner adds its fast paths (the
    CPU's are described in astrai/backends/cpu/runner.py), so that a model the fast paths do
    not fit is seen, not silently slow."""

    packs_prefill = False  # whether a prefill step's rows go unpadded (its token budget then counts real tokens)
    # how a decode step's attention may read the contexts; here always gathered from the pages
    decode_attention_reads: tuple[str, ...] = ("gathered",)
    runs_greedy = False  # whether ``greedy_run`` can take several steps in one call
    runs_speculative = False  # whether ``speculative_run`` can take several verify steps in one call
    # whether decoding rows may ride along a prefill step (one token each, after the prompt
    # rows) at the cost of their own attention: the scheduler then mixes them in
    mixes_decode = False

    def __init__(self, model: nn.Module, cache: KVCache, in_place: bool = False):
        self.model = self.prepare(model if in_place else copy.deepcopy(model))
        self.cache = cache
        self.device = next(self.model.parameters()).device
        self.backend = backend_for(self.device)
        self.decode_paths = dict.fromkeys(self.backend.decode_paths, 0)  # every key present: readers copy it from other threads
        self.decode_attention = dict.fromkeys(self.decode_attention_reads, 0)
        # the final hidden states [B, dim] at the positions of the last forward's logits, when it
        # ran the model's own forward (None after a step a kernel ran whole): a prompt's last one
        # is what a draft head drafts its first tokens from
        self.last_hidden: Optional[torch.Tensor] = None

    def decode_path_counts(self) -> dict[str, int]:
        """Decode steps so far by the path that ran them (see the class docstring)."""
        return dict(self.decode_paths)

    def decode_attention_counts(self) -> dict[str, int]:
        """Decode steps so far by how their attention read the contexts (``decode_attention_reads``)."""
        return dict(self.decode_attention)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Make ``model`` (the runner's own) ready to serve: eval mode."""
        return model.eval()

    def forward(self, rows: Sequence[Row]) -> tuple[torch.Tensor, Optional[list[int]]]:
        """Each row's last position's logits [B, V], and their argmax when the step found it on
        the way (None here)."""
        self.last_hidden = None
        logits = self.model_forward(rows)
        if all(len(r.tokens) == 1 for r in rows):
            self.decode_paths[PLAIN_DECODE_PATH] += 1
            self.decode_attention["gathered"] += 1
        return logits, None

    def model_forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """The rows' logits from the model's own forward over the bound cache view."""
        return self.model_logits(self.bind(rows), rows)

    def bind(self, rows: Sequence[Row]):
        table = self.table(rows)
        return self.cache.bind(table, [r.start for r in rows], [len(r.tokens) for r in rows])

    def table(self, rows: Sequence[Row]) -> torch.Tensor:
        """The rows' page table, wide enough for the step even for tasks aborted meanwhile."""
        return self.cache.make_table_tensor([r.task_id for r in rows], self.device,
                                            n_tokens=max(r.start + len(r.tokens) for r in rows))

    def model_logits(self, view, rows: Sequence[Row]) -> torch.Tensor:
        """The model's forward over the rows' tokens, padded to the longest; last positions' logits."""
        T = max(len(r.tokens) for r in rows)
        input_ids = torch.tensor([r.tokens + [0] * (T - len(r.tokens)) for r in rows], device=self.device)
        logits_index = None if T == 1 else torch.tensor([len(r.tokens) - 1 for r in rows], device=self.device)
        out = self.model(input_ids, paged_cache=view, position_ids=view.position_ids, logits_index=logits_index)
        self.last_hidden = out["hidden_states"][:, -1]
        return out["logits"][:, -1]

    def verify(self, rows: Sequence[Row]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The logits [n, V] and final hidden states [n, dim] of every position each row feeds: a
        speculative step, whose rows are each a task's last token and the tokens drafted after it
        (a draft head drafts from the hidden state)."""
        return self.every_position(self.bind(rows), rows)

    def every_position(self, view, rows: Sequence[Row]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The model's forward over the rows' tokens, padded to the longest; each row's logits and
        hidden states."""
        T = max(len(r.tokens) for r in rows)
        input_ids = torch.tensor([r.tokens + [0] * (T - len(r.tokens)) for r in rows], device=self.device)
        out = self.model(input_ids, paged_cache=view, position_ids=view.position_ids)
        return [(out["logits"][b, :len(r.tokens)], out["hidden_states"][b, :len(r.tokens)])
                for b, r in enumerate(rows)]

    def rewind(self, task_id: str, length: int) -> None:
        """Only the first ``length`` cached positions of ``task_id`` are its context (a speculative
        step's rejected drafts lie past them, to be overwritten): here nothing keeps a copy of the
        context whose length must follow, the pages are read up to each step's own length."""

    def decode_order(self, rows: Sequence[Row]) -> list[int]:
        """The order (indices into ``rows``) in which a decode step's rows run best."""
        return list(range(len(rows)))

    def greedy_run(self, run: GreedyRun) -> Optional[list[int]]:
        """The tokens of a run of greedy steps, or None when this runner takes one step at a time."""
        return None

    def speculative_run(self, run: GreedyRun, drafter, hidden: Optional[torch.Tensor], row: DraftRow):
        """A run of greedy verify steps of one row, drafting with ``drafter``: the fused draft head
        (``fused_draft_head``), which drafts from ``hidden`` (the final hidden state that chose
        the row's last token; None: the first step drafts nothing), or ``LookupDrafts``; each
        step follows ``row``'s drafting as SpeculationControl.record does. The run ends as a
        greedy run does, and after a step that takes the kept fraction below ``row.min_kept``.
        The result has ``tokens``, per verify step ``drafted`` and ``kept_drafts``, and ``hidden``
        (with a head: the state that chose the last token); None when this runner checks drafts
        one step at a time (``runs_speculative`` false)."""
        return None

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the served model (its layout and modules stay as prepared)."""
        with torch.no_grad():
            self.model.load_state_dict(state)

    def release_idle(self) -> None:
        """The calling thread computes nothing for a while (it built the model, handed the loop
        work, or is the loop about to wait): its backend gives back what the thread holds idle."""
        self.backend.release_idle()

    def release_scratch(self) -> None:
        """Free the scratch memory the calling thread's matmuls keep between calls (none here)."""
