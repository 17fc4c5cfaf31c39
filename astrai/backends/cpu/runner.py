"""CpuModelRunner: the model runner with the CPU backend's fast paths.

It prepares its model for serving (serving.py: stacked weights, serving modules, packed
copies, huge pages), keeps the decode batch's contexts in dense buffers across steps
(decode_buffers.py), binds the CPU attention views (attention.py), and runs a single
request's decode step, or a run of greedy steps, through the fused C step when the model
fits it (fused_decode.py), counting the decode steps each path ran (``decode_path_counts``:
a step of the model's forward is "row_kernels" when every matmul in it ran on the C kernels,
"batched" when the others took oneDNN's packed weights or the split, "torch" when any fell
back to plain torch, per serving.py's tally of kernels). Every step's result is the one the plain runner would give; only
the kernels differ. The CPU backend registers it for the device kind "cpu" (astrai/backends/cpu/__init__.py),
with those four path names. ``decode_attention_counts`` says how each decode step's attention
read the contexts: from the decode buffers, from the page store in place when the buffers
would outgrow their budget (attention.py's PagedDecodeView) or when the decoding rows ride
along a prefill step (MixedStepView, counted once a step), or gathered (a model or cache dtype
the kernels do not take).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import nn

from astrai.backends.cpu.attention import CpuKvcacheView, DecodeView, MixedStepView, PagedDecodeView
from astrai.backends.cpu.decode_buffers import DecodeBuffers, RowTarget
from astrai.backends.cpu.dense_matmul import release_slab_buffer
from astrai.backends.cpu.fused_decode import FusedDecode
from astrai.backends.cpu.fused_head import FusedHead
from astrai.backends.cpu.kernels import SpeculativeSteps
from astrai.backends.cpu.serving import kernel_counts, prepare_for_serving
from astrai.inference.cache import KVCache
from astrai.inference.runner import DraftRow, GreedyRun, LookupDrafts, ModelRunner, Row


class CpuModelRunner(ModelRunner):
    # decode attention over the decode buffers (the fused step's too), over the page store in
    # place (the buffers would outgrow their budget), or over contexts gathered from the pages
    decode_attention_reads = ("buffers", "pages", "gathered")

    def __init__(self, model: nn.Module, cache: KVCache, in_place: bool = False):
        super().__init__(model, cache, in_place)
        self.decode_buffers = DecodeBuffers(cache.storage)
        # SDPA's causal kernel per row beats the masked kernel over padded rows (attention.py)
        self.packs_prefill = getattr(self.model.config, "attn_type", None) == "gqa"
        self.fused_decode = FusedDecode.for_model(self.model)
        self.runs_greedy = self.runs_speculative = self.fused_decode is not None
        # decode rows may attend in place in the page store: past the decode buffers' budget,
        # and riding along a prefill step (which the scheduler then mixes in)
        self.mixes_decode = self.paged_decode = self.packs_prefill and PagedDecodeView.usable(cache.storage)

    def fused_draft_head(self, head: nn.Module) -> Optional[FusedHead]:
        """A draft head's one-row drafting in one C call (fused_head.py), or None where it does not fit."""
        return FusedHead.for_head(head)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        super().load_weights(state)
        if self.fused_decode is not None:
            self.fused_decode.recheck()  # running requests step on with the new weights at once

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        prepare_for_serving(model)
        return model

    def forward(self, rows: Sequence[Row]) -> tuple[torch.Tensor, Optional[list[int]]]:
        self.last_hidden = None
        if (len(rows) == 1 and len(rows[0].tokens) == 1 and self.fused_decode is not None
                and self.fused_decode.ready(rows[0].task_id)):
            row = rows[0]
            target = self.decode_target(row.task_id, row.start)
            fused = None if target is None else self.fused_decode(row.tokens[0], target)
            if fused is not None:
                self.decode_paths["fused"] += 1
                self.decode_attention["buffers"] += 1
                return fused[0], [fused[1]]
        if any(len(r.tokens) != 1 for r in rows):
            return self.model_forward(rows), None
        counts = kernel_counts()
        before = (counts["kernel"], counts["torch"] + counts["dense"], sum(counts.values()))
        logits = self.model_forward(rows)
        kernel, fallback, total = (counts["kernel"] - before[0], counts["torch"] + counts["dense"] - before[1],
                                   sum(counts.values()) - before[2])
        self.decode_paths["torch" if fallback else "row_kernels" if kernel == total else "batched"] += 1
        return logits, None

    def bind(self, rows: Sequence[Row]):
        table = self.table(rows)
        start, n_new = [r.start for r in rows], [len(r.tokens) for r in rows]
        if all(n == 1 for n in n_new):
            ids = [r.task_id for r in rows]
            refill = self.decode_buffers.plan(ids, start)
            pages = [self.cache.task_pages(t) for t in ids]
            if refill is not None:
                self.decode_attention["buffers"] += 1
                return DecodeView(self.cache.storage, table, pages, start, self.decode_buffers, refill)
            if self.paged_decode:
                self.decode_attention["pages"] += 1
                return PagedDecodeView(self.cache.storage, pages, start)
            self.decode_attention["gathered"] += 1
        elif self.mixes_decode and n_new[-1] == 1:
            return self._mixed_view(rows, table, start, n_new)
        return CpuKvcacheView(self.cache.storage, table, start, n_new, packed=self.packs_prefill)

    def _mixed_view(self, rows: Sequence[Row], table: torch.Tensor, start: Sequence[int],
                    n_new: Sequence[int]) -> MixedStepView:
        """A step whose last rows feed one token each (decoding rows riding along a prefill
        step): those rows attend in place in the page store, the rows before them as a prefill
        (packed, or on the shared-prefix path)."""
        split = max(i for i, n in enumerate(n_new) if n > 1) + 1
        prompts = CpuKvcacheView(self.cache.storage, table[:split], start[:split], n_new[:split], packed=True)
        decoding = PagedDecodeView(self.cache.storage, [self.cache.task_pages(r.task_id) for r in rows[split:]],
                                   start[split:])
        self.decode_attention["pages"] += 1
        return MixedStepView(prompts, decoding)

    def model_logits(self, view, rows: Sequence[Row]) -> torch.Tensor:
        if not getattr(view, "packed", False):
            return super().model_logits(view, rows)
        input_ids = torch.tensor([[token for r in rows for token in r.tokens]], device=self.device)
        ends = torch.tensor([len(r.tokens) for r in rows], device=self.device).cumsum(0) - 1
        out = self.model(input_ids, paged_cache=view, position_ids=view.position_ids, logits_index=ends.view(1, -1))
        self.last_hidden = out["hidden_states"][0]
        return out["logits"][0]

    def verify(self, rows: Sequence[Row]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A lone row through the fused C step's verification (``FusedDecode.verify``: each weight
        read once for all its tokens, the context read from the decode buffers), else the
        model's forward over the bound view."""
        if len(rows) == 1 and self.fused_decode is not None and self.fused_decode.ready(rows[0].task_id):
            row = rows[0]
            target = self.decode_target(row.task_id, row.start, len(row.tokens))
            verified = None if target is None else self.fused_decode.verify(row.tokens, target)
            if verified is not None:
                return [verified]
        return self.every_position(self.bind(rows), rows)

    def every_position(self, view, rows: Sequence[Row]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not getattr(view, "packed", False):
            return super().every_position(view, rows)
        input_ids = torch.tensor([[token for r in rows for token in r.tokens]], device=self.device)
        out = self.model(input_ids, paged_cache=view, position_ids=view.position_ids)
        lengths = [len(r.tokens) for r in rows]
        return list(zip(out["logits"][0].split(lengths), out["hidden_states"][0].split(lengths)))

    def rewind(self, task_id: str, length: int) -> None:
        """The decode buffers' row of ``task_id``, when it holds the task, counts ``length``
        tokens, so that the next decode step finds it in place instead of copying the context
        from the pages again."""
        self.decode_buffers.rewind(task_id, length)

    def decode_order(self, rows: Sequence[Row]) -> list[int]:
        """The order that keeps the decode buffers' rows in place (DecodeBuffers.preferred_order)."""
        return self.decode_buffers.preferred_order([r.task_id for r in rows], [r.start for r in rows])

    def greedy_run(self, run: GreedyRun) -> Optional[list[int]]:
        if self.fused_decode is None or not self.fused_decode.ready(run.row.task_id):
            return None
        row = run.row
        target = self.decode_target(row.task_id, row.start, run.steps)
        if target is None:
            return None
        tokens = self.fused_decode.greedy_steps(row.tokens[0], target, run.stop_ids, run.max_seconds)
        if tokens is not None:
            self.decode_paths["fused"] += len(tokens)
            self.decode_attention["buffers"] += len(tokens)
        return tokens

    def speculative_run(self, run: GreedyRun, drafter, hidden: Optional[torch.Tensor],
                        row: DraftRow) -> Optional[SpeculativeSteps]:
        if isinstance(drafter, FusedHead):
            drafts = drafter.plan
        elif isinstance(drafter, LookupDrafts):
            drafts = (drafter.context, drafter.min_n, drafter.max_n)
        else:
            return None
        if self.fused_decode is None or not self.fused_decode.ready(run.row.task_id):
            return None
        target = self.decode_target(run.row.task_id, run.row.start, run.steps)
        if target is None:
            return None
        return self.fused_decode.speculative_steps(run.row.tokens[0], target, drafts, hidden, run.stop_ids,
                                                   run.max_seconds, dataclasses.asdict(row))

    def decode_target(self, task_id: str, pos: int, steps: int = 1) -> Optional[RowTarget]:
        """``steps`` decode steps of ``task_id`` alone, the first one's token at ``pos``, prepared
        for the fused step, which writes K/V itself: the decode buffers hold the task's context
        in row 0 (copied from the pages when it has just been prefilled) with room for the
        steps' tokens, and the target says where each token goes (the task's pages must cover
        positions up to ``pos + steps - 1``). None when the buffers would outgrow their budget
        or the task is gone; the step then binds a view as usual.

        The buffers count the row as ``pos + steps`` tokens long afterwards; a run of steps that
        ends early says how many ran (``RowTarget.ran``), so the next step finds the row in place."""
        pages, ps = self.cache.task_pages(task_id), self.cache.page_size
        if len(pages) * ps < pos + steps:  # also a task aborted meanwhile (no pages)
            return None
        refill = self.decode_buffers.plan((task_id,), (pos,), steps)
        if refill is None:
            return None
        if refill and pos:
            slots = [pages[p // ps] * ps + p % ps for p in range(pos)]
            self.decode_buffers.fill_row(0, torch.tensor(slots, device=self.cache.storage.device))
        slots = tuple(pages[p // ps] * ps + p % ps for p in range(pos, pos + steps))
        return RowTarget(slots, pos, self.decode_buffers.capacity, self.decode_buffers, self.cache.storage)

    def release_scratch(self) -> None:
        release_slab_buffer()
