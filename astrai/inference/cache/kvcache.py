"""KVCache: the paged cache the scheduler manages, and the per-step view the model sees.

The scheduler asks ``KVCache`` for pages (``task_alloc`` reuses cached prefix pages,
``task_extend`` grows a task by a page when decoding crosses a page boundary,
``task_free`` releases them) and, once per forward, the model runner ``bind``s a
``KvcacheView`` for the rows of that step. The view precomputes every index the model
needs - where each new token is written, which slots make up each row's context, the
attention mask by absolute position - so each layer's ``write``/``gather`` is one index
op per tensor. The view is also the attention backend the model calls once per layer.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from astrai.inference.cache.page_pool import PagePool
from astrai.inference.cache.prefix_cache import ROOT
from astrai.inference.cache.storage import Storage
from astrai.inference.cache.task_table import TaskTable
from astrai.model.components.attention import attend

NEVER_AGAIN = 1 << 62  # "pages recorded" value that stops a task's chain from being recorded further


class KvcacheView:
    """What one forward's attention layers read and write (the model's ``paged_cache``), and
    the default attention backend: ``attend`` stores a layer's new K/V in the pages and runs
    ``scaled_dot_product_attention`` over each row's context gathered from them.

    Row b holds ``n_new[b]`` new tokens at absolute positions ``start[b]...``; rows
    are padded to T new tokens and S context tokens. Padding writes go to the sink
    page; padding queries repeat the row's last real position so every mask row has
    a True. ``position_ids`` [B, T] is what the caller passes to the model.
    """

    def __init__(self, storage: Storage, page_table: torch.Tensor, start: Sequence[int], n_new: Sequence[int]):
        self._storage = storage
        device = storage.device
        ps = storage.page_size
        B, T = len(n_new), max(n_new)
        lens = [s + n for s, n in zip(start, n_new)]
        S = max(lens)
        self._batch = B
        self._total_len = S
        sink = storage.sink_page * ps
        s_idx = torch.arange(S, device=device)
        self._slots = page_table.index_select(1, s_idx // ps) * ps + s_idx % ps  # [B, S]
        start_t = torch.tensor(start, device=device)
        n_new_t = torch.tensor(n_new, device=device)
        t_idx = torch.arange(T, device=device)
        offsets = torch.minimum(t_idx.unsqueeze(0), (n_new_t - 1).unsqueeze(1))
        self.position_ids = start_t.unsqueeze(1) + offsets
        self._real = t_idx.unsqueeze(0) < n_new_t.unsqueeze(1)  # [B, T]: the queries that are not padding
        uniform = all(n == T for n in n_new) and all(length == S for length in lens)
        written = self._slots.gather(1, self.position_ids)
        if uniform:
            self._gather_slots = self._slots.reshape(-1)
            self._write_slots = written.reshape(-1)
        else:
            lens_t = start_t + n_new_t
            self._gather_slots = torch.where(s_idx.unsqueeze(0) < lens_t.unsqueeze(1), self._slots, sink).reshape(-1)
            self._write_slots = torch.where(self._real, written, sink).reshape(-1)
        # Without a mask the model attends to everything (T == 1) or is causal (T == S).
        if uniform and (T == 1 or T == S):
            self.attn_mask: Optional[torch.Tensor] = None
        else:
            self.attn_mask = (s_idx.view(1, 1, S) <= self.position_ids.unsqueeze(2)).unsqueeze(1)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._storage.write(layer_idx, self._write_slots, k, v)

    def gather(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's context K/V [B, S, heads, width] (positions past a row's end are the sink's)."""
        return self._storage.gather(layer_idx, self._gather_slots, self._batch)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               expand: Optional[Callable] = None) -> torch.Tensor:
        """Store the step's ``k``/``v`` for layer ``layer_idx`` and return the attention of ``q``
        [B, T, H, D] over every row's context. ``expand(k, v)`` turns what the cache holds into
        K/V (MLA's latent); without it the cache holds K/V themselves."""
        self.write(layer_idx, k, v)
        k, v = self.gather(layer_idx)
        k, v = k.to(q.dtype), v.to(q.dtype)  # a 16-bit cache is widened as it is read
        if expand is not None:
            k, v = expand(k, v)
        return attend(q, k, v, self.attn_mask)


class KVCache:
    """Pages for tasks: allocation with prefix reuse, growth, release and binding."""

    def __init__(self, n_layers: int, cache_shapes, num_pages: int, page_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", prefix_cache: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.page_size = page_size
        self._storage = Storage(n_layers, num_pages, page_size, cache_shapes, dtype, device)
        self._pool = PagePool(num_pages, page_size, prefix_cache)
        self._table = TaskTable(pad_page=self._storage.sink_page)

    @classmethod
    def for_model(cls, model, num_pages: int, page_size: int = 16, prefix_cache: bool = True,
                  dtype: Optional[torch.dtype] = None) -> "KVCache":
        """A cache of ``model``'s shapes, in ``dtype`` (default: the model's first parameter's)."""
        param = next(model.parameters())
        return cls(model.config.n_layers, model.cache_shapes(), num_pages, page_size,
                   dtype=dtype or param.dtype, device=param.device, prefix_cache=prefix_cache)

    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def pool(self) -> PagePool:
        return self._pool

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    def pages_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.page_size)

    def task_alloc(self, task_id: str, token_ids: Sequence[int], reserve: int = 0,
                   donor: Optional[tuple[str, int]] = None) -> bool:
        """Give a task pages for ``token_ids``, reusing cached full pages of its prefix.

        At least one token is always left to compute (its logits are needed), so a
        prompt made entirely of cached pages recomputes its last page. ``donor`` is
        ``(task_id, n)``: a task holding pages whose first ``n`` tokens equal these and
        are computed. What it holds past the shared full pages (a page not yet full, which
        the prefix cache cannot share) is copied into this task's own pages: a group of
        samples of one prompt then computes the prompt once. Fails (False, nothing held)
        unless ``reserve`` pages would remain available afterwards.
        """
        if task_id in self._table:
            raise RuntimeError(f"task {task_id} already holds pages")
        n = len(token_ids)
        shared = self._pool.lookup(token_ids, max_pages=(n - 1) // self.page_size)
        for page in shared:
            self._pool.inc_ref(page)
        need = self.pages_for(n) - len(shared)
        if self._pool.allocator.num_available < need + reserve:
            for page in reversed(shared):
                self._pool.free(page)
            return False
        pages = shared + [self._pool.alloc() for _ in range(need)]
        copied = 0
        if donor is not None and donor[0] in self._table:
            first, end = len(shared) * self.page_size, min(donor[1], n - 1)
            if end > first:
                self._copy_positions(self._table.get(donor[0]), pages, first, end)
                copied = end - first
        self._table.set(task_id, pages, cached=len(shared), copied=copied)
        return True

    def _copy_positions(self, src_pages: list[int], dst_pages: list[int], first: int, end: int) -> None:
        """Copy positions ``first..end-1`` of one task's pages into the same positions of another's."""
        ps = self.page_size
        positions = torch.arange(first, end)
        offsets = positions % ps

        def slots(pages: list[int]) -> torch.Tensor:
            return torch.tensor(pages, dtype=torch.long)[positions // ps] * ps + offsets

        device = self._storage.device
        self._storage.copy_slots(slots(src_pages).to(device), slots(dst_pages).to(device))

    def task_extend(self, task_id: str, pos: int) -> bool:
        """Make the task's pages cover positions < ``pos``; False if no page is left."""
        pages = self._table.get(task_id)
        while len(pages) * self.page_size < pos:
            page = self._pool.alloc()
            if page is None:
                return False
            pages.append(page)
        return True

    def task_free(self, task_id: str) -> None:
        """Release a task's pages; deepest first, so the LRU evicts leaves before their parents."""
        if task_id not in self._table:
            return
        pages, _ = self._table.pop(task_id)
        for page in reversed(pages):
            self._pool.free(page)

    def task_cached(self, task_id: str) -> int:
        """Tokens of the task's prompt it did not have to compute: from the prefix cache or its donor."""
        return self._table.get_cached(task_id) * self.page_size + self._table.get_copied(task_id)

    def task_record_hashes(self, task_id: str, token_ids: Sequence[int], n_computed: int) -> None:
        """Register the task's newly completed full pages for prefix sharing.

        ``token_ids`` is the task's context and ``n_computed`` how many of its tokens
        are in the cache. Pages are registered by exact content under their parent;
        once one is refused (its content is cached elsewhere) the rest of the chain
        stays private, since children must hang under a registered parent.
        """
        if not self._pool.prefix_enabled or task_id not in self._table:
            return
        ps = self.page_size
        pages = self._table.get(task_id)
        start = self._table.get_recorded(task_id)
        full = min(n_computed // ps, len(pages))
        for i in range(start, full):
            parent = pages[i - 1] if i > 0 else ROOT
            if not self._pool.record(pages[i], token_ids[i * ps:(i + 1) * ps], parent):
                self._table.set_recorded(task_id, NEVER_AGAIN)
                return
        self._table.set_recorded(task_id, max(start, full))

    def make_table_tensor(self, task_ids: list[str], device=None, n_tokens: int = 0) -> torch.Tensor:
        """[B, pages] page table; at least wide enough for ``n_tokens`` positions (rows of
        tasks aborted meanwhile are all sink pages and must still cover the step)."""
        return self._table.table_tensor(task_ids, device or self._storage.device, min_width=self.pages_for(n_tokens))

    def task_pages(self, task_id: str) -> list[int]:
        """The task's pages in order (empty for a task no longer held: aborted meanwhile)."""
        return self._table.get(task_id) if task_id in self._table else []

    def bind(self, page_table: torch.Tensor, start: Sequence[int], n_new: Sequence[int]) -> KvcacheView:
        """The plain view for one forward (a backend binds its own views over the same pages)."""
        return KvcacheView(self._storage, page_table, start, n_new)

    def clear_prefix(self) -> None:
        self._pool.clear_prefix()

    def stats(self) -> dict[str, int]:
        return self._pool.stats()
