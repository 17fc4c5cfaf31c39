"""DecodeBuffers: dense per-layer copies of the decode batch's contexts, kept across steps.

Reading K/V through the page table means copying every row's whole context out of
the page store in every layer at every step - for a batch of long contexts that copy
costs more than the rest of the decode step. Between two decode steps nothing in a
task's context changes except its one new token. So the buffers keep each decoding
task's context densely laid out ([rows, heads, capacity, width] per layer: heads
first, so each head's keys are one contiguous matrix that attention multiplies
without a copy); each step appends the new token to them (besides the page store,
which stays the source of truth), and ``gather`` returns a slice of the buffer.

When the batch changes - tasks finish, join after their prefill, or are preempted -
the runner puts the step's tasks in ``preferred_order``: tasks keep their rows, a
hole left by a finished task takes the task from the last row (one row copied), and
newcomers take the remaining rows, their contexts gathered from the pages. Any other
order still works: the rows that stay are then moved into it with one copy into a
second set of buffers (the two sets swap). Growth past the capacity or the row count
copies the held rows into bigger buffers; the row count at least doubles each time. A
batch whose own rows exceed the memory budget reads its contexts from the pages, and the
buffers are freed until a batch fits again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from astrai.inference.cache.storage import Storage

HEADROOM = 256  # tokens of growth before the buffers must be rebuilt
ROW_STEP = 8  # a batch's rows are added in groups, so tasks joining one by one do not reallocate each time
BUDGET_BYTES = 1024**3  # both sets together; above this the view falls back to gathering every step


class DecodeBuffers:
    """The buffers of one cache's decode rows (see the module's docstring)."""

    def __init__(self, storage: Storage, budget_bytes: int = BUDGET_BYTES):
        self._storage = storage
        self._budget = budget_bytes
        self.task_ids: tuple = ()
        self.lens: list[int] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._spare: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.rows = self.capacity = 0
        self.valid = False
        self.generation = 0  # counts replacements of the k/v lists: a table of their addresses is stale when it moved

    def plan(self, task_ids: Sequence[str], start: Sequence[int], steps: int = 1) -> Optional[list[int]]:
        """Prepare the buffers for a decode step where row i is ``task_ids[i]`` with
        ``start[i]`` tokens cached (or for ``steps`` steps in a row, each adding one token).
        Returns the rows whose contexts must be gathered from the pages this step (empty when
        every row is already in place), or None when the buffers would exceed their memory
        budget (the step then gathers as usual)."""
        ids = tuple(task_ids)
        needed = max(start) + steps
        st = self._storage
        if len(ids) > self.rows or needed > self.capacity:
            capacity = max(-(-(needed + HEADROOM) // st.page_size) * st.page_size, self.capacity)
            # a single stream takes one row: a spare row of a long context is tens of megabytes
            # zeroed before use (seven spare rows took its first step at 2,048 tokens from 74 to
            # 250-990 ms); a second task brings a group
            rows = max(1 if len(ids) == 1 else -(-len(ids) // ROW_STEP) * ROW_STEP, self.rows)
            if len(ids) > self.rows and self._fits(2 * self.rows, capacity):
                rows = max(rows, 2 * self.rows)  # doubling: a batch filling up reallocates log(n) times, not n/8
            if not self._fits(rows, capacity):
                rows = len(ids)  # long contexts: rows for this batch only, none spare
            if not self._fits(rows, capacity):
                self.release()
                return None
            self._allocate(rows, capacity)
        source = self._held_rows(ids, start)
        kept = {i for i, row in enumerate(source) if row >= 0}
        refill = [i for i in range(len(ids)) if i not in kept]
        moves = [(i, source[i]) for i in sorted(kept) if source[i] != i]
        if moves and all(src >= len(ids) for _, src in moves):
            self._copy_rows(moves)  # rows from past the batch's end into its holes: no overlap
        elif moves:
            self._move_rows([source[i] if i in kept else 0 for i in range(len(ids))])
        self.task_ids, self.lens, self.valid = ids, [s + steps for s in start], True
        return refill

    def release(self) -> None:
        """Drop the buffers (a batch past the budget gathers from the pages instead): memory
        they no longer serve is not held while the contexts are long; smaller ones allocate again."""
        self.valid, self.task_ids, self.lens = False, (), []
        self.k = self.v = []
        self._spare = ([], [])
        self.rows = self.capacity = 0
        self.generation += 1

    def shorten(self, row: int, length: int) -> None:
        """Row ``row`` holds ``length`` tokens, not the count its ``plan`` gave it: a run of
        decode steps that ended before its last step."""
        if not 0 <= length <= self.lens[row]:
            raise ValueError(f"row {row} holds {self.lens[row]} tokens at most, not {length}")
        self.lens[row] = length

    def rewind(self, task_id: str, length: int) -> None:
        """``task_id``'s row, if held, counts only its first ``length`` tokens (a speculative
        step wrote drafted tokens past them that were not accepted)."""
        if self.valid and task_id in self.task_ids:
            row = self.task_ids.index(task_id)
            if length <= self.lens[row]:
                self.lens[row] = length

    def _fits(self, rows: int, capacity: int) -> bool:
        return 2 * rows * capacity * self._storage.bytes_per_token() <= self._budget

    def preferred_order(self, task_ids: Sequence[str], start: Sequence[int]) -> list[int]:
        """An order of this step's tasks (indices into ``task_ids``) that leaves the rows already
        in the buffers where they are: tasks whose row is inside the new batch keep it, and the
        holes left by tasks that ended are filled first by tasks from rows past the new batch's
        end (one row copied each), then by newcomers (gathered from the pages)."""
        n = len(task_ids)
        row_of = self._held_rows(task_ids, start)
        order: list[Optional[int]] = [None] * n
        for i, row in enumerate(row_of):
            if 0 <= row < n:
                order[row] = i
        movers = [i for i, row in enumerate(row_of) if row >= n] + [i for i, row in enumerate(row_of) if row < 0]
        holes = [slot for slot in range(n) if order[slot] is None]
        for slot, i in zip(holes, movers):
            order[slot] = i
        return order

    def _held_rows(self, task_ids: Sequence[str], start: Sequence[int]) -> list[int]:
        """The buffer row holding each task's context up to ``start``, or -1 (not held, or stale)."""
        if not self.valid:
            return [-1] * len(task_ids)
        rows = {tid: row for row, tid in enumerate(self.task_ids)}
        held = []
        for tid, s in zip(task_ids, start):
            row = rows.get(tid, -1)
            held.append(row if row >= 0 and self.lens[row] == s else -1)
        return held

    def _allocate(self, rows: int, capacity: int) -> None:
        """New buffers; the rows already held are copied over (those that still fit: fewer rows
        but a longer capacity is what a long context may take), so growing reads nothing from
        the pages."""
        old_k, old_v = (self.k, self.v) if self.valid else ([], [])
        self.task_ids, self.lens = self.task_ids[:rows], self.lens[:rows]
        self.k = self.v = []
        self._spare = ([], [])  # released; made again when a reorder first needs it
        self.rows, self.capacity = rows, capacity
        self.k, self.v = self._new_set(zeroed=not old_k)
        self.generation += 1
        for new, old in zip(self.k + self.v, old_k + old_v):
            held_rows, held_len = min(old.shape[0], rows), old.shape[2]
            old = old[:held_rows]
            # zero only what the copy leaves uncovered: the buffers are large, and zeroing them
            # whole before the copy would write most of them twice
            new[:held_rows, :, :held_len].copy_(old)
            new[:held_rows, :, held_len:].zero_()
            new[held_rows:].zero_()

    def _new_set(self, zeroed: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One buffer per layer for K and for V. Every element must be finite before it is read:
        masked positions are still multiplied. So a set is zeroed unless its caller fills it."""
        st = self._storage
        make = torch.zeros if zeroed else torch.empty

        def per_layer(like: torch.Tensor, heads: int, width: int) -> list[torch.Tensor]:
            return [make(self.rows, heads, self.capacity, width, dtype=like.dtype, device=like.device)
                    for _ in range(st.n_layers)]

        return per_layer(st.k_cache, st.k_heads, st.k_width), per_layer(st.v_cache, st.v_heads, st.v_width)

    def _copy_rows(self, moves: list[tuple[int, int]]) -> None:
        """Copy row ``src`` to row ``dst`` for each (dst, src), in place."""
        device = self._storage.device
        dst = torch.tensor([d for d, _ in moves], device=device)
        src = torch.tensor([s for _, s in moves], device=device)
        for buf in self.k + self.v:
            buf.index_copy_(0, dst, buf.index_select(0, src))

    def _move_rows(self, source_rows: list[int]) -> None:
        """New row i takes old row ``source_rows[i]``: one copy per layer into the spare set, then swap."""
        index = torch.tensor(source_rows, device=self._storage.device)
        n = len(source_rows)
        if not self._spare[0]:
            self._spare = self._new_set()
        spare_k, spare_v = self._spare
        for layer in range(self._storage.n_layers):
            torch.index_select(self.k[layer], 0, index, out=spare_k[layer][:n])
            torch.index_select(self.v[layer], 0, index, out=spare_v[layer][:n])
        self._spare = (self.k, self.v)
        self.k, self.v = spare_k, spare_v
        self.generation += 1

    def fill_row(self, row: int, slots: torch.Tensor) -> None:
        """Copy the page-store ``slots`` (a context's positions 0, 1, ... in order) into ``row``
        of every layer's buffers: a task's context arriving from its prefill."""
        n, st = slots.numel(), self._storage
        for layer in range(st.n_layers):
            self.k[layer][row, :, :n].copy_(st.k_cache[layer].index_select(0, slots).transpose(0, 1))
            self.v[layer][row, :, :n].copy_(st.v_cache[layer].index_select(0, slots).transpose(0, 1))


@dataclass
class RowTarget:
    """One-row decode steps served by the decode buffers, for a kernel that does the whole
    step itself (fused_decode.py): the first token's position (its context is positions
    0..pos, all but the last already in row 0 of ``buffers``), the page-store ``slots`` where
    each step's K/V go besides the buffers (positions pos, pos + 1, ...), and the buffers'
    ``capacity``."""

    slots: tuple[int, ...]
    pos: int
    capacity: int
    buffers: DecodeBuffers
    storage: Storage

    @property
    def slot(self) -> int:
        return self.slots[0]

    def ran(self, steps: int) -> None:
        """Only the first ``steps`` of the target's steps ran (a run ended early): the buffers
        then count the row as ``pos + steps`` tokens, so the next step finds it in place."""
        self.buffers.shorten(0, self.pos + steps)
