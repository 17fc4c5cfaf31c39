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
        self.capacity = 0

    def reset(self) -> None:
        self.task_ids, self.lens, self.k, self.v, self.capacity = (), [], [], [], 0

    def plan(self, task_ids: Sequence[str], start: Sequence[int]) -> Optional[bool]:
        """For a decode step: None (don't use buffers), False (append) or True (rebuild).

        Called once per step before binding; on success the buffers describe the
        contexts as they will be after this step.
        """
        ids = tuple(task_ids)
        needed = max(start) + 1
        if ids == self.task_ids and list(start) == self.lens and needed <= self.capacity:
            self.lens = [s + 1 for s in start]
            return False
        st = self._storage
        capacity = -(-(needed + HEADROOM) // st.page_size) * st.page_size
        if len(ids) * capacity * st.bytes_per_token() > self._budget:
            self.reset()
            return None
        if len(ids) != len(self.task_ids) or capacity > self.capacity or not self.k:
            shape_k = (len(ids), capacity, st.k_heads, st.k_width)
            shape_v = (len(ids), capacity, st.v_heads, st.v_width)
            # zeros, not empty: masked positions are still multiplied, so they must be finite
            self.k = [st.k_cache.new_zeros(shape_k) for _ in range(st.n_layers)]
            self.v = [st.v_cache.new_zeros(shape_v) for _ in range(st.n_layers)]
            self.capacity = capacity
        self.task_ids = ids
        self.lens = [s + 1 for s in start]
        return True
