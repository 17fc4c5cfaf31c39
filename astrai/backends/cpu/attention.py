"""The CPU attention backend: views of the paged cache whose ``attend`` takes faster paths.

The model calls ``paged_cache.attend(layer_idx, q, k, v)`` once per layer; these views
answer it as the plain ``KvcacheView`` does, only through other kernels where the CPU gains:

- ``CpuKvcacheView`` (prefill, and decode steps the decode buffers do not serve): rows
  whose contexts begin with the same cached pages, making at least half of the longest
  context, attend to that prefix in one matmul for all of them (cascade attention)
  instead of a gathered copy per row; prefill rows of
  different lengths come ``packed``, one unpadded row of every task's tokens, and attend
  one at a time (SDPA's causal kernel skips the masked half).
- ``DecodeView`` (decode steps over ``DecodeBuffers``): each row's context is already
  dense and heads-first, so one query per row attends through the C kernel, which reads
  each row's own length only, or else through two batched matmuls over the buffers.
- ``PagedDecodeView`` (decode steps whose contexts outgrow the decode buffers' budget: many
  long rows): the C kernel reads each row's K/V where they lie in the page store, through
  the row's page list, so a step copies nothing however long its contexts are.
- ``MixedStepView`` (a prefill step with decoding rows riding along, one token each, after
  the prompt rows): the prompt rows attend as in ``CpuKvcacheView`` (packed, or padded on the
  shared-prefix path), the one-token rows as
  in ``PagedDecodeView``, so riding along costs a decode row its own attention and no more.

MLA layers pass ``expand`` and keep the plain path: what they cache is a latent that must
be expanded to K/V before any of these paths could read it.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from astrai.backends.cpu.decode_buffers import DecodeBuffers
from astrai.backends.cpu.kernels import (attention_workspace, decode_attention, kernels_available, kv_kind,
                                        paged_decode_attention)
from astrai.inference.cache import KvcacheView, Storage
from astrai.model.components.attention import attend


class CpuKvcacheView(KvcacheView):
    """A ``KvcacheView`` with the shared-prefix and per-row paths (see the module's docstring)."""

    def __init__(self, storage: Storage, page_table: torch.Tensor, start: Sequence[int], n_new: Sequence[int],
                 packed: bool = False):
        super().__init__(storage, page_table, start, n_new)
        B, T, S = len(n_new), max(n_new), self._total_len
        self.shared_len = self._shared_prefix_len(page_table, start) if B > 1 and self.attn_mask is not None else 0
        if 2 * self.shared_len < S:
            # cascade attention saves reading the prefix again per row, not arithmetic, and its
            # suffix part is a dense masked matmul over padded rows: it pays only while the
            # prefix is most of the context (a few system-prompt pages before thousands of
            # tokens of each row's own chat take the packed rows, several times faster)
            self.shared_len = 0
        # packed (several prefill rows of different lengths, no shared prefix): the rows' new
        # tokens follow each other in one row [1, N] with no padding, so no matmul computes
        # padding; the mask and the context slots stay per row, for attention row by row
        self.packed = packed and B > 1 and T > 1 and self.attn_mask is not None and not self.shared_len
        self.row_spans = list(zip(start, n_new)) if self.packed else None
        if self.packed:
            self._write_slots = self._write_slots.view(B, T)[self._real]  # the padding's sink writes dropped
            self.position_ids = self.position_ids[self._real].unsqueeze(0)
        if self.shared_len:
            P = self.shared_len
            self._shared_slots = self._slots[0, :P]
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

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               expand: Optional[Callable] = None) -> torch.Tensor:
        if expand is not None or not (self.shared_len or self.packed):
            return super().attend(layer_idx, q, k, v, expand)
        self.write(layer_idx, k, v)
        if self.shared_len:  # a 16-bit cache is widened as it is read
            shared = [t.to(q.dtype) for t in self._storage.gather(layer_idx, self._shared_slots, 1)]
            suffix = [t.to(q.dtype) for t in self._storage.gather(layer_idx, self._suffix_slots, self._batch)]
            return attend_shared_prefix(q, (shared[0][0], shared[1][0]), suffix, self.suffix_mask)
        k, v = self.gather(layer_idx)
        return attend_rows(q, k.to(q.dtype), v.to(q.dtype), self.attn_mask, self.row_spans)


class DecodeView(KvcacheView):
    """The view of a decode step (one new token per row) served by the decode buffers.

    Built from plain lists rather than the parent's tensor arithmetic: a decode step of a
    small model is short enough that thirty small index ops would be a noticeable part of
    it. ``pages[b]`` are row b's pages (empty for a task aborted meanwhile: its write goes
    to the sink page). Only newcomer rows (``refill``) read their contexts from the pages.
    """

    def __init__(self, storage: Storage, page_table: torch.Tensor, pages: Sequence[Sequence[int]],
                 start: Sequence[int], dense: DecodeBuffers, refill: Sequence[int]):
        self._storage, self._dense = storage, dense
        device, ps = storage.device, storage.page_size
        B, S = len(start), max(start) + 1
        self._batch, self._total_len = B, S
        sink = storage.sink_page
        self._write_slots = torch.tensor(
            [(p[s // ps] if s // ps < len(p) else sink) * ps + s % ps for p, s in zip(pages, start)], device=device)
        self.position_ids = torch.tensor(start, device=device).unsqueeze(1)
        # row b's context is its first start[b] + 1 positions: the kernel reads only those and
        # needs no mask (the mask below serves the batched matmuls)
        self.context_lens = self.position_ids.view(B) + 1
        self.attn_mask = None
        if any(s != start[0] for s in start):
            # additive (0 / -inf): adding it to the scores is cheaper than a broadcast
            # masked_fill_, and it is built once per step for all layers
            beyond = torch.arange(S, device=device).view(1, 1, 1, S) > self.position_ids.view(B, 1, 1, 1)
            self.attn_mask = torch.zeros(beyond.shape, dtype=storage.k_cache.dtype, device=device).masked_fill_(
                beyond, float("-inf"))
        # where each row's new token goes in the buffers viewed as [rows * heads * capacity, width]
        cap = dense.capacity
        self._k_slots = torch.tensor([(b * storage.k_heads + h) * cap + s for b, s in enumerate(start)
                                      for h in range(storage.k_heads)], device=device)
        self._v_slots = self._k_slots if storage.v_heads == storage.k_heads else torch.tensor(
            [(b * storage.v_heads + h) * cap + s for b, s in enumerate(start) for h in range(storage.v_heads)],
            device=device)
        self._refill = None
        if refill:  # newcomers: their whole contexts come from the pages this step
            self._refill = torch.tensor(list(refill), dtype=torch.long, device=device)
            s_idx = torch.arange(S, device=device)
            slots = page_table.index_select(0, self._refill).index_select(1, s_idx // ps) * ps + s_idx % ps
            lens = torch.tensor([start[b] + 1 for b in refill], device=device)
            self._refill_slots = torch.where(s_idx < lens.unsqueeze(1), slots, sink * ps).reshape(-1)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._storage.write(layer_idx, self._write_slots, k, v)
        k_buf, v_buf = self._dense.k[layer_idx], self._dense.v[layer_idx]
        k_buf.view(-1, k_buf.shape[-1]).index_copy_(0, self._k_slots, k.reshape(-1, k_buf.shape[-1]).to(k_buf.dtype))
        v_buf.view(-1, v_buf.shape[-1]).index_copy_(0, self._v_slots, v.reshape(-1, v_buf.shape[-1]).to(v_buf.dtype))

    def gather(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, heads, width] views of the heads-first buffers (newcomers' rows filled first)."""
        B, S = self._batch, self._total_len
        k_buf = self._dense.k[layer_idx][:B, :, :S].transpose(1, 2)
        v_buf = self._dense.v[layer_idx][:B, :, :S].transpose(1, 2)
        if self._refill is not None:
            k, v = self._storage.gather(layer_idx, self._refill_slots, len(self._refill))
            k_buf[self._refill] = k
            v_buf[self._refill] = v
        return k_buf, v_buf

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               expand: Optional[Callable] = None) -> torch.Tensor:
        if expand is not None:
            return super().attend(layer_idx, q, k, v, expand)
        self.write(layer_idx, k, v)
        k, v = self.gather(layer_idx)
        if q.dtype == torch.float32 and kernels_available() and kv_kind(k.dtype) is not None:
            return decode_attention(q.contiguous(), k, v, self.context_lens, q.shape[-1] ** -0.5, lengths_checked=True)
        return attend_one_query(q, k.to(q.dtype), v.to(q.dtype), self.attn_mask)  # a 16-bit cache widened


class PagedDecodeView(KvcacheView):
    """The view of a decode step (one new token per row) whose attention reads the page store
    in place (``paged_decode_attention``). ``pages[b]`` are row b's pages; a row whose pages do
    not cover its context (a task aborted meanwhile) reads and writes the sink page instead,
    whose values are finite, and its result is discarded. Only for K/V layers (not MLA's
    latent) in a dtype the kernels read, with the kernels built: ``usable`` says."""

    def __init__(self, storage: Storage, pages: Sequence[Sequence[int]], start: Sequence[int]):
        self._storage = storage
        device, ps, sink = storage.device, storage.page_size, storage.sink_page
        B = len(start)
        self._batch, self._total_len = B, max(start) + 1
        width = -(-self._total_len // ps)
        table = [list(p[:width]) if len(p) * ps > s else [] for p, s in zip(pages, start)]
        self._pages = torch.tensor([p + [sink] * (width - len(p)) for p in table], dtype=torch.long, device=device)
        self._write_slots = self._pages[torch.arange(B), torch.tensor(start) // ps] * ps + torch.tensor(start) % ps
        self.position_ids = torch.tensor(start, device=device).unsqueeze(1)
        self.context_lens = self.position_ids.view(B) + 1
        self.attn_mask = None
        self._workspace = None  # made by the first layer, reused by the others

    @staticmethod
    def usable(storage: Storage) -> bool:
        return kernels_available() and kv_kind(storage.k_cache.dtype) is not None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               expand: Optional[Callable] = None) -> torch.Tensor:
        if expand is not None:
            raise ValueError("PagedDecodeView reads K/V layers only, not a latent to expand")
        st = self._storage
        st.write(layer_idx, self._write_slots, k, v)
        if self._workspace is None:
            heads = q.shape[2]
            self._workspace = attention_workspace(self._batch, st.k_heads, heads // st.k_heads, st.v_width,
                                                  self._pages.shape[1] * st.page_size, torch.get_num_threads())
        out = paged_decode_attention(q.contiguous().float(), st.k_cache[layer_idx], st.v_cache[layer_idx],
                                     self.context_lens, self._pages, st.page_size, q.shape[-1] ** -0.5,
                                     workspace=self._workspace)
        return out.to(q.dtype)


class MixedStepView:
    """The view of a packed step whose first rows feed prompt chunks (``prompts``, a
    ``CpuKvcacheView`` of them: packed, a single row, or padded rows) and whose last rows feed one token
    each (``decoding``): the model's packed row [1, N] holds the prompt rows' tokens, then
    one token per decoding row, and each part attends through its own view."""

    packed = True

    def __init__(self, prompts: CpuKvcacheView, decoding: PagedDecodeView):
        self._prompts, self._decoding = prompts, decoding
        # prompt rows not packed (the shared-prefix path) take their tokens padded [B, T]: the packed
        # tokens are scattered into that shape and gathered back around their attention
        self._padded = prompts._real if not prompts.packed and prompts.position_ids.shape[0] > 1 else None
        positions = prompts.position_ids if self._padded is None else prompts.position_ids[self._padded].unsqueeze(0)
        self._split = positions.shape[1]  # the prompt rows' tokens, first in the row
        self.position_ids = torch.cat((positions, decoding.position_ids.view(1, -1)), dim=1)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(*self._padded.shape, *x.shape[2:])
        padded[self._padded] = x[0]
        return padded

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               expand: Optional[Callable] = None) -> torch.Tensor:
        n = self._split
        if self._padded is None:
            head = self._prompts.attend(layer_idx, q[:, :n], k[:, :n], v[:, :n], expand)
        else:
            head = self._prompts.attend(layer_idx, self._pad(q[:, :n]), self._pad(k[:, :n]), self._pad(v[:, :n]),
                                        expand)[self._padded].unsqueeze(0)
        tail = self._decoding.attend(layer_idx, q[0, n:].unsqueeze(1), k[0, n:].unsqueeze(1), v[0, n:].unsqueeze(1),
                                     expand)
        return torch.cat((head, tail.view(1, -1, *tail.shape[2:])), dim=1)


def attend_one_query(q, k, v, attn_mask, scale: Optional[float] = None):
    """Decode attention (one query per row) as two ``bmm`` calls, for K/V [B, S, Hkv, D] views
    of heads-first memory: each group's keys are a ready [S, D] matrix, which the matmuls
    stream once, and the query heads sharing a K/V head become the rows of one matmul, so
    grouped-query attention needs no K/V copy. Rows and K/V heads are flattened into bmm's
    batch, sparing 4-D ``matmul``'s reshaping."""
    B, _, H, D = q.shape
    Hkv, S = k.shape[2], k.shape[1]
    keys = k.transpose(1, 2).flatten(0, 1)  # [B*Hkv, S, D]: a view of the buffers, no copy
    values = v.transpose(1, 2).flatten(0, 1)
    queries = q.reshape(B * Hkv, H // Hkv, D)
    scores = torch.bmm(queries, keys.transpose(1, 2)).mul_(scale if scale is not None else D ** -0.5)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # [B, 1, 1, S], True = may attend
        scores.view(B, Hkv, H // Hkv, S).masked_fill_(~attn_mask, float("-inf"))
    elif attn_mask is not None:  # [B, 1, 1, S], added: 0 = may attend, -inf = may not
        scores.view(B, Hkv, H // Hkv, S).add_(attn_mask)
    out = torch.bmm(scores.softmax(dim=-1), values)  # [B*Hkv, H/Hkv, Dv]
    return out.view(B, 1, H, values.shape[-1])


def attend_rows(q, k, v, attn_mask, spans):
    """Prefill attention of several rows packed into one, without padding.

    ``spans[b]`` = (start, n): row b's n new queries at positions start... over its start + n
    context tokens (``k``/``v`` [B, S, Hkv, *], padded); the queries are one row [1, N, H, D],
    row b's n following row b-1's, and so is the result. A row starting at 0 takes SDPA's
    causal kernel (which skips the masked half) instead of the masked kernel over the whole
    padded [T, S] block; a row continuing a chunked prompt gets its own slice of ``attn_mask``.
    """
    parts, offset = [], 0
    for b, (start, n) in enumerate(spans):
        end = start + n
        mask = None if start == 0 else attn_mask[b:b + 1, :, :n, :end]
        parts.append(attend(q[:, offset:offset + n], k[b:b + 1, :end], v[b:b + 1, :end], mask))
        offset += n
    return torch.cat(parts, dim=1)


def attend_shared_prefix(q, shared, suffix, suffix_mask):
    """Attention of rows whose contexts begin with the same cached prefix (cascade attention).

    q [B,T,H,D]; ``shared`` = (K, V) [P, Hkv, *] of the common prefix, which every query
    may see; ``suffix`` = (K, V) [B, S', Hkv, *], each row's own keys after it, masked by
    ``suffix_mask`` [B, 1, T, S']. The prefix is read once and multiplied with all rows'
    queries in one matmul per K/V head, instead of being gathered into every row. One
    softmax runs over the prefix and suffix scores together, so the result is the plain
    attention over the whole context.
    """
    (k_shared, v_shared), (k, v) = shared, suffix
    B, T, H, D = q.shape
    P, Hkv = k_shared.shape[0], k_shared.shape[1]
    rep, S = H // Hkv, k.shape[1]
    queries = q.reshape(B, T, Hkv, rep, D).permute(2, 0, 1, 3, 4).reshape(Hkv, B * T * rep, D)
    prefix_scores = torch.bmm(queries, k_shared.permute(1, 2, 0)).view(Hkv, B, T * rep, P)
    suffix_scores = torch.matmul(queries.view(Hkv, B, T * rep, D), k.permute(2, 0, 3, 1))  # [Hkv, B, T*rep, S']
    allowed = suffix_mask.view(B, T, 1, S).expand(B, T, rep, S).reshape(1, B, T * rep, S)
    suffix_scores.masked_fill_(~allowed, float("-inf"))
    probs = torch.cat((prefix_scores, suffix_scores), dim=-1).mul_(D ** -0.5).softmax(dim=-1)
    out = torch.bmm(probs[..., :P].reshape(Hkv, B * T * rep, P), v_shared.transpose(0, 1))
    out = out.view(Hkv, B, T * rep, -1) + torch.matmul(probs[..., P:], v.permute(2, 0, 1, 3))
    return out.view(Hkv, B, T, rep, -1).permute(1, 2, 0, 3, 4).reshape(B, T, H, -1)
