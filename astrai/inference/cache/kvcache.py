"""KVCache: the paged cache the scheduler manages, and the per-step view the model sees.

The scheduler asks ``KVCache`` for pages (``task_alloc`` reuses cached prefix pages,
``task_extend`` grows a task by a page when decoding crosses a page boundary,
``task_free`` releases them) and, once per forward, ``bind``s a ``KvcacheView`` for
the rows of that step. The view precomputes every index the model needs - where each
new token is written, which slots make up each row's context, the attention mask by
absolute position - so each layer's ``write``/``gather`` is one index op per tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from astrai.inference.cache.decode_buffers import DecodeBuffers
from astrai.inference.cache.page_pool import PagePool
from astrai.inference.cache.prefix_cache import ROOT
from astrai.inference.cache.storage import Storage
from astrai.inference.cache.task_table import TaskTable

NEVER_AGAIN = 1 << 62  # "pages recorded" value that stops a task's chain from being recorded further


@dataclass
class RowTarget:
    """One-row decode steps served by the decode buffers, for a kernel that does the whole
    step itself (astrai/inference/fused_decode.py): the first token's position (its context
    is positions 0..pos, all but the last already in row 0 of ``buffers``), the page-store
    ``slots`` where each step's K/V go besides the buffers (positions pos, pos + 1, ...), and
    the buffers' ``capacity``."""

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


class KvcacheView:
    """What one forward's attention layers read and write (the model's ``paged_cache``).

    Row b holds ``n_new[b]`` new tokens at absolute positions ``start[b]...``; rows
    are padded to T new tokens and S context tokens. Padding writes go to the sink
    page; padding queries repeat the row's last real position so every mask row has
    a True. ``position_ids`` [B, T] is what the caller passes to the model ([1, N], the
    rows' real tokens one after the other, when the view is ``packed``).
    """

    def __init__(self, storage: Storage, page_table: torch.Tensor, start: Sequence[int], n_new: Sequence[int],
                 packed: bool = False):
        self._storage = storage
        self._dense: Optional[DecodeBuffers] = None
        self._refill: Optional[torch.Tensor] = None
        self.context_lens: Optional[torch.Tensor] = None  # decode steps over the buffers only (see for_decode)
        device = storage.device
        ps = storage.page_size
        B, T = len(n_new), max(n_new)
        lens = [s + n for s, n in zip(start, n_new)]
        S = max(lens)
        self._batch = B
        self._total_len = S
        sink = storage.sink_page * ps
        s_idx = torch.arange(S, device=device)
        slots = page_table.index_select(1, s_idx // ps) * ps + s_idx % ps
        start_t = torch.tensor(start, device=device)
        n_new_t = torch.tensor(n_new, device=device)
        t_idx = torch.arange(T, device=device)
        offsets = torch.minimum(t_idx.unsqueeze(0), (n_new_t - 1).unsqueeze(1))
        self.position_ids = start_t.unsqueeze(1) + offsets
        uniform = all(n == T for n in n_new) and all(length == S for length in lens)
        if uniform:
            self._gather_slots = slots.reshape(-1)
            self._write_slots = slots.gather(1, self.position_ids).reshape(-1)
        else:
            lens_t = start_t + n_new_t
            self._gather_slots = torch.where(s_idx.unsqueeze(0) < lens_t.unsqueeze(1), slots, sink).reshape(-1)
            written = slots.gather(1, self.position_ids)
            self._write_slots = torch.where(t_idx.unsqueeze(0) < n_new_t.unsqueeze(1), written, sink).reshape(-1)
        # Without a mask the model attends to everything (T == 1) or is causal (T == S).
        if uniform and (T == 1 or T == S):
            self.attn_mask: Optional[torch.Tensor] = None
        else:
            self.attn_mask = (s_idx.view(1, 1, S) <= self.position_ids.unsqueeze(2)).unsqueeze(1)
        self.shared_len = self._shared_prefix_len(page_table, start) if B > 1 and self.attn_mask is not None else 0
        # several padded prefill rows on CPU: attention runs row by row without the padding
        # (GQA's _attend_rows); with a shared prefix the cascade path below reads it once instead
        self.row_spans: Optional[list[tuple[int, int]]] = None
        if B > 1 and T > 1 and self.attn_mask is not None and not self.shared_len and device.type == "cpu":
            self.row_spans = list(zip(start, n_new))
        # packed (asked for by a caller whose model attends by row_spans): the rows' new tokens
        # follow each other in one row [1, N] with no padding, so no product computes padding;
        # the mask and the context slots stay per row, for the attention
        self.packed = packed and self.row_spans is not None
        if self.packed:
            real = t_idx.unsqueeze(0) < n_new_t.unsqueeze(1)
            self._write_slots = self._write_slots.view(B, T)[real]  # the padding's sink writes dropped
            self.position_ids = self.position_ids[real].unsqueeze(0)
        if self.shared_len:
            P = self.shared_len
            self._shared_slots = slots[0, :P]
            self._suffix_slots = self._gather_slots.view(B, S)[:, P:].reshape(-1)
            self.suffix_mask = self.attn_mask[..., P:]

    def _shared_prefix_len(self, page_table: torch.Tensor, start: Sequence[int]) -> int:
        """Tokens at the start of every row's context held in the very same pages (a prefix
        shared through the prefix cache) and computed before this step, in whole pages."""
        ps = self._storage.page_size
        width = min(start) // ps
        if width == 0:
            return 0
        same = (page_table[:, :width] == page_table[:1, :width]).all(0)
        return int(same.int().cumprod(0).sum()) * ps

    @classmethod
    def for_decode(cls, storage: Storage, page_table: torch.Tensor, pages: Sequence[Sequence[int]],
                   start: Sequence[int], dense: DecodeBuffers, refill: Sequence[int]) -> "KvcacheView":
        """The view of a decode step (one new token per row) served by the decode buffers.

        Built from plain lists: a decode step of a small model lasts about a millisecond,
        and the tensor arithmetic of the general constructor (some thirty small ops) cost
        a tenth of it. ``pages[b]`` are row b's pages (empty for a task aborted meanwhile:
        its write goes to the sink page). Only newcomer rows (``refill``) read the pages.
        """
        view = cls.__new__(cls)
        view._storage, view._dense = storage, dense
        device, ps = storage.device, storage.page_size
        B, S = len(start), max(start) + 1
        view._batch, view._total_len = B, S
        view.shared_len = 0  # the buffers already hold each row's context; nothing to split
        view.row_spans, view.packed = None, False
        sink = storage.sink_page
        view._write_slots = torch.tensor(
            [(p[s // ps] if s // ps < len(p) else sink) * ps + s % ps for p, s in zip(pages, start)], device=device)
        view.position_ids = torch.tensor(start, device=device).unsqueeze(1)
        # row b's context is its first start[b] + 1 positions: a kernel reading only those
        # needs no mask (the mask below serves the batched products)
        view.context_lens = view.position_ids.view(B) + 1
        view.attn_mask = None
        if any(s != start[0] for s in start):
            # additive (0 / -inf) rather than boolean: adding it to the scores took 25 against
            # 78 µs per layer of a broadcast masked_fill_ (41 rows of 519 tokens, captured from
            # the 64-request benchmark), and it is built once per step for all layers
            beyond = torch.arange(S, device=device).view(1, 1, 1, S) > view.position_ids.view(B, 1, 1, 1)
            view.attn_mask = torch.zeros(beyond.shape, dtype=storage.k_cache.dtype, device=device).masked_fill_(
                beyond, float("-inf"))
        # where each row's new token goes in the buffers viewed as [rows * heads * capacity, width]
        cap = dense.capacity
        view._k_slots = torch.tensor([(b * storage.k_heads + h) * cap + s for b, s in enumerate(start)
                                      for h in range(storage.k_heads)], device=device)
        view._v_slots = view._k_slots if storage.v_heads == storage.k_heads else torch.tensor(
            [(b * storage.v_heads + h) * cap + s for b, s in enumerate(start) for h in range(storage.v_heads)],
            device=device)
        view._refill = None
        if refill:  # newcomers: their whole contexts come from the pages this step
            view._refill = torch.tensor(list(refill), dtype=torch.long, device=device)
            s_idx = torch.arange(S, device=device)
            slots = page_table.index_select(0, view._refill).index_select(1, s_idx // ps) * ps + s_idx % ps
            lens = torch.tensor([start[b] + 1 for b in refill], device=device)
            view._refill_slots = torch.where(s_idx < lens.unsqueeze(1), slots, sink * ps).reshape(-1)
        return view

    def gather_shared(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefix's K/V once for all rows, [shared_len, heads, width] each."""
        k, v = self._storage.gather(layer_idx, self._shared_slots, 1)
        return k[0], v[0]

    @property
    def total_len(self) -> int:
        return self._total_len

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._storage.write(layer_idx, self._write_slots, k, v)
        if self._dense is not None:
            k_buf, v_buf = self._dense.k[layer_idx], self._dense.v[layer_idx]
            k_buf.view(-1, k_buf.shape[-1]).index_copy_(0, self._k_slots, k.reshape(-1, k_buf.shape[-1]).to(k_buf.dtype))
            v_buf.view(-1, v_buf.shape[-1]).index_copy_(0, self._v_slots, v.reshape(-1, v_buf.shape[-1]).to(v_buf.dtype))

    def gather(self, layer_idx: int, split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's context K/V [B, S, heads, width]; with ``split`` (and ``shared_len`` > 0)
        only the part after the shared prefix, to be masked with ``suffix_mask``."""
        if split and self.shared_len:
            return self._storage.gather(layer_idx, self._suffix_slots, self._batch)
        if self._dense is None:
            return self._storage.gather(layer_idx, self._gather_slots, self._batch)
        B, S = self._batch, self._total_len
        # [B, S, heads, width] views of the heads-first buffers
        k_buf = self._dense.k[layer_idx][:B, :, :S].transpose(1, 2)
        v_buf = self._dense.v[layer_idx][:B, :, :S].transpose(1, 2)
        if self._refill is not None:
            k, v = self._storage.gather(layer_idx, self._refill_slots, len(self._refill))
            k_buf[self._refill] = k
            v_buf[self._refill] = v
        return k_buf, v_buf


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
        self._dense = DecodeBuffers(self._storage)

    @classmethod
    def for_model(cls, model, num_pages: int, page_size: int = 16, prefix_cache: bool = True) -> "KVCache":
        param = next(model.parameters())
        return cls(model.config.n_layers, model.cache_shapes(), num_pages, page_size,
                   dtype=param.dtype, device=param.device, prefix_cache=prefix_cache)

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

    def has_task(self, task_id: str) -> bool:
        return task_id in self._table

    def task_alloc(self, task_id: str, token_ids: Sequence[int], reserve: int = 0) -> bool:
        """Give a task pages for ``token_ids``, reusing cached full pages of its prefix.

        At least one token is always left to compute (its logits are needed), so a
        prompt made entirely of cached pages recomputes its last page. Fails (False,
        nothing held) unless ``reserve`` pages would remain available afterwards.
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
        self._table.set(task_id, pages, cached=len(shared))
        return True

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
        """Tokens of the task's prompt that came from the prefix cache."""
        return self._table.get_cached(task_id) * self.page_size

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

    def bind(self, page_table: torch.Tensor, start: Sequence[int], n_new: Sequence[int],
             task_ids: Optional[Sequence[str]] = None, packed: bool = False) -> KvcacheView:
        """The view for one forward. Given ``task_ids``, a decode step (one new token per
        row) reads the contexts from dense buffers kept across steps instead of
        re-gathering them from the pages (see DecodeBuffers). ``packed`` lets a prefill step
        of several rows lay its tokens out in one unpadded row (the view says whether it did)."""
        if task_ids is not None and all(n == 1 for n in n_new):
            refill = self._dense.plan(task_ids, start)
            if refill is not None:
                pages = [self._table.get(t) if t in self._table else () for t in task_ids]
                return KvcacheView.for_decode(self._storage, page_table, pages, start, self._dense, refill)
        return KvcacheView(self._storage, page_table, start, n_new, packed=packed)

    def decode_target(self, task_id: str, pos: int, steps: int = 1) -> Optional[RowTarget]:
        """``steps`` decode steps of ``task_id`` alone, the first one's token at ``pos``, prepared
        for a kernel that writes K/V itself: the decode buffers hold the task's context in row 0
        (copied from the pages when it has just been prefilled) with room for the steps' tokens,
        and the target says where each token goes (``task_extend`` must have covered positions
        up to ``pos + steps - 1``). None when the buffers would outgrow their budget; the step
        then binds a view as usual.

        Meant for the engine's fused step (fp32 CPU storage): it skips the view, whose tensors
        of indices cost a tenth of a millisecond a step that the kernel does not need. The
        buffers count the row as ``pos + steps`` tokens long afterwards; a run of steps that
        ends early says how many ran (``RowTarget.ran``), so the next step finds the row in
        place. Were it not told, the next step would refill the row from the pages (which the
        kernel wrote as well) instead of trusting it."""
        try:
            pages, ps = self._table.get(task_id), self.page_size
        except KeyError:  # aborted meanwhile (from another thread): the usual view writes it to the sink
            return None
        if len(pages) * ps < pos + steps:
            return None
        refill = self._dense.plan((task_id,), (pos,), steps)
        if refill is None:
            return None
        if refill and pos:
            slots = [pages[p // ps] * ps + p % ps for p in range(pos)]
            self._dense.fill_row(0, torch.tensor(slots, device=self._storage.device))
        slots = tuple(pages[p // ps] * ps + p % ps for p in range(pos, pos + steps))
        return RowTarget(slots, pos, self._dense.capacity, self._dense, self._storage)

    def decode_order(self, task_ids: Sequence[str], start: Sequence[int]) -> list[int]:
        """The order of a decode step's tasks that keeps the decode buffers' rows in place
        (indices into ``task_ids``; see DecodeBuffers.preferred_order)."""
        return self._dense.preferred_order(task_ids, start)

    def clear_prefix(self) -> None:
        self._pool.clear_prefix()

    def stats(self) -> dict[str, int]:
        return self._pool.stats()
