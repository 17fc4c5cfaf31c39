"""DecodeBuffers: dense per-layer copies of a steady decode batch's contexts.

Reading K/V through the page table means copying every row's whole context out of
the page store in every layer at every step - for a batch of long contexts that copy
costs more than the rest of the decode step. While the decode batch stays the same
(same tasks, each one token further), nothing in those contexts changes except the
one new token per row. So after one gather, these buffers keep the batch's contexts
densely laid out ([B, capacity, heads, width] per layer), each step appends the new
token to them (besides the page store, which stays the source of truth), and
``gather`` returns a slice of the buffer without copying. Any change - a task joins,
leaves, is preempted, or the capacity is exceeded - triggers one fresh gather.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from astrai.inference.cache.storage import Storage

HEADROOM = 256  # tokens of growth before the buffers must be rebuilt
BUDGET_BYTES = 256 * 1024**2  # above this the view falls back to gathering every step


class DecodeBuffers:
    def __init__(self, storage: Storage, budget_bytes: int = BUDGET_BYTES):
        self._storage = storage
        self._budget = budget_bytes
        self.task_ids: tuple = ()
        self.lens: list[int] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows = self.capacity = 0
        self.valid = False

    def plan(self, task_ids: Sequence[str], start: Sequence[int]) -> Optional[bool]:
        """For a decode step: None (gather from the pages as usual), True (fill the
        buffers from the pages this step) or False (append to the buffers).

        A batch that just changed is gathered normally - batches change often while
        requests join and leave, and filling buffers then would only add a copy; the
        buffers are filled on the first step the batch is seen unchanged.
        """
        ids = tuple(task_ids)
        steady = ids == self.task_ids and list(start) == self.lens
        self.task_ids, self.lens = ids, [s + 1 for s in start]
        needed = max(start) + 1
        if not steady:
            self.valid = False
            return None
        if self.valid and needed <= self.capacity:
            return False
        st = self._storage
        capacity = -(-(needed + HEADROOM) // st.page_size) * st.page_size
        if len(ids) * capacity * st.bytes_per_token() > self._budget:
            self.valid = False
            return None
        if len(ids) > self.rows or capacity > self.capacity:
            self.k = self.v = []  # release the old buffers before allocating bigger ones
            rows, capacity = max(len(ids), self.rows), max(capacity, self.capacity)
            # zeros, not empty: masked positions are still multiplied, so they must be finite
            self.k = [st.k_cache.new_zeros(rows, capacity, st.k_heads, st.k_width) for _ in range(st.n_layers)]
            self.v = [st.v_cache.new_zeros(rows, capacity, st.v_heads, st.v_width) for _ in range(st.n_layers)]
            self.rows, self.capacity = rows, capacity
        self.valid = True
        return True
