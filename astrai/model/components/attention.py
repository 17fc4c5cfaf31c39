"""Attention: GQA and MLA, both through ``scaled_dot_product_attention``.

With ``paged_cache`` (a ``KvcacheView`` bound by the inference engine) an attention
layer writes the new tokens' K/V for its layer and reads back the whole context; the
view also supplies the boolean mask [B, 1, T, S] (True = may attend) that encodes
causality by absolute position. Without a cache, ``attn_mask`` is either None (pure
causal, the fast path) or a boolean mask built by the Transformer.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from astrai.config import ModelConfig
from astrai.factory import BaseFactory
from astrai.model.components.layers import Linear, RMSNorm, apply_rotary, linear_group, select_positions
from astrai.model.components.native_kernels import decode_attention, decode_attention_available


class AttnFactory(BaseFactory[nn.Module]):
    """attn_type → attention class ('gqa', 'mla')."""

    kind = "attention type"


def _attend(q, k, v, attn_mask: Optional[torch.Tensor], scale: Optional[float] = None,
            context_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B,T,H,D], k/v [B,S,Hkv,*] → [B,T,H,Dv]; Hkv divides H (grouped-query attention).

    ``context_lens`` [B] (a decode step over the engine's decode buffers: row b attends
    to its first ``context_lens[b]`` positions, as ``attn_mask`` also says) lets the CPU
    use astrai's decode attention kernel, which reads no padding (native_kernels.py).

    Without a mask the fused kernels take the K/V groups directly (``enable_gqa``),
    sparing the copy that ``repeat_interleave`` makes. With a mask on CUDA, K/V are
    expanded first, because the masked (memory-efficient) kernel has no GQA support
    and SDPA would otherwise fall back to the slow math path, except for one query per
    row (decode), where the query heads of a group become that group's queries
    (``_attend_grouped_query``) and nothing is copied; on CPU the masked
    kernel handles groups itself (about 3× faster than copying, measured on batched
    decode).
    """
    n_rep = q.shape[2] // k.shape[2]
    if q.shape[1] == 1 and q.device.type == "cpu" and _heads_first(k) and _heads_first(v):
        if context_lens is not None and q.dtype == torch.float32 and decode_attention_available():
            return decode_attention(q.contiguous(), k, v, context_lens,  # the decode view's lengths: in 1..S
                                    scale if scale is not None else q.shape[-1] ** -0.5, lengths_checked=True)
        return _attend_one_query(q, k, v, attn_mask, scale)
    if n_rep > 1 and attn_mask is not None and q.device.type == "cuda":
        if q.shape[1] == 1:
            return _attend_grouped_query(q, k, v, attn_mask, scale)
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    causal = attn_mask is None and q.shape[2] > 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def _attend_grouped_query(q, k, v, attn_mask, scale):
    """One query per row, q [B,1,H,D], as SDPA over [B, Hkv, H/Hkv, D]: the query heads that share
    a K/V head are that head's query rows, and the mask [B,1,1,S] broadcasts over them. The masked
    kernel then reads each K/V head once instead of a ``repeat_interleave`` copy per query head."""
    B, _, H, D = q.shape
    Hkv = k.shape[2]
    queries = q.reshape(B, Hkv, H // Hkv, D)
    out = F.scaled_dot_product_attention(queries, k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                                         scale=scale)
    return out.reshape(B, 1, H, v.shape[-1])


def _heads_first(x: torch.Tensor) -> bool:
    """True for [B, S, H, D] views of heads-first memory (the decode buffers' layout)."""
    return x.stride(3) == 1 and x.stride(1) == x.shape[3] and x.shape[1] > 1


def _attend_one_query(q, k, v, attn_mask, scale):
    """Decode attention (one query per row) as two ``bmm`` calls on CPU.

    With K/V heads-first in memory, each group's keys are a ready [S, D] matrix, and
    the products stream them once: measured 1.25 ms against SDPA's 2.0 ms for 48 rows
    of ~770 tokens (the step is bound by reading K/V, and SDPA's CPU kernel does not
    reach the bandwidth for a single query). The query heads sharing a K/V head
    become the rows of one product, so grouped-query attention needs no K/V copy.
    (Rows and K/V heads are flattened into bmm's batch: 4-D ``matmul`` adds about
    12 µs of reshaping per call, a third of a short single-row attention.)
    """
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


def _attend_rows(q, k, v, attn_mask, spans, packed: bool = False):
    """Prefill attention of several rows, one row at a time, without padding.

    ``spans[b]`` = (start, n): row b's n new queries at positions start... over its
    start + n context tokens (``k``/``v`` [B, S, Hkv, *], padded). A row starting at 0
    takes SDPA's causal kernel (which skips the masked half) instead of the masked
    kernel over the whole padded [T, S] block; a row continuing a chunked prompt gets its
    own slice of ``attn_mask``. On CPU, for the padded rows of the 64-request benchmark's
    prefill steps, this took 1.41 against 2.57 ms (rows of 300 and 200 tokens) and 2.23
    against 5.93 ms (500 and 12). With ``packed`` the queries are one unpadded row
    [1, N, H, D], row b's n following row b-1's, and so is the result; otherwise
    q is [B, T, H, D] and the padding queries' output is zero.
    """
    parts, offset = [], 0
    for b, (start, n) in enumerate(spans):
        end = start + n
        queries = q[:, offset:offset + n] if packed else q[b:b + 1, :n]
        mask = None if start == 0 else attn_mask[b:b + 1, :, :n, :end]
        parts.append(_attend(queries, k[b:b + 1, :end], v[b:b + 1, :end], mask))
        offset += n
    if packed:
        return torch.cat(parts, dim=1)
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    for b, (part, (_, n)) in enumerate(zip(parts, spans)):
        out[b:b + 1, :n] = part
    return out


def _attend_shared_prefix(q, shared, suffix, suffix_mask):
    """Attention of rows whose contexts begin with the same cached prefix (cascade attention).

    q [B,T,H,D]; ``shared`` = (K, V) [P, Hkv, *] of the common prefix, which every query
    may see; ``suffix`` = (K, V) [B, S', Hkv, *], each row's own keys after it, masked by
    ``suffix_mask`` [B, 1, T, S']. The prefix is read once and multiplied with all rows'
    queries in one product per K/V head, instead of being gathered into every row:
    measured 3.5 ms against 5.5-8.7 ms per layer for 15 rows of 24 new tokens behind a
    992-token prefix. One softmax runs over the prefix and suffix scores together, so the
    result is the plain attention over the whole context.
    """
    (k_shared, v_shared), (k, v) = shared, suffix
    B, T, H, D = q.shape
    P, Hkv = k_shared.shape[0], k_shared.shape[1]
    rep, S = H // Hkv, k.shape[1]
    queries = q.view(B, T, Hkv, rep, D).permute(2, 0, 1, 3, 4).reshape(Hkv, B * T * rep, D)
    prefix_scores = torch.bmm(queries, k_shared.permute(1, 2, 0)).view(Hkv, B, T * rep, P)
    suffix_scores = torch.matmul(queries.view(Hkv, B, T * rep, D), k.permute(2, 0, 3, 1))  # [Hkv, B, T*rep, S']
    allowed = suffix_mask.view(B, T, 1, S).expand(B, T, rep, S).reshape(1, B, T * rep, S)
    suffix_scores.masked_fill_(~allowed, float("-inf"))
    probs = torch.cat((prefix_scores, suffix_scores), dim=-1).mul_(D ** -0.5).softmax(dim=-1)
    out = torch.bmm(probs[..., :P].reshape(Hkv, B * T * rep, P), v_shared.transpose(0, 1))
    out = out.view(Hkv, B, T * rep, -1) + torch.matmul(probs[..., P:], v.permute(2, 0, 1, 3))
    return out.view(Hkv, B, T, rep, -1).permute(1, 2, 0, 3, 4).reshape(B, T, H, -1)


def _rotate_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``apply_rotary`` to q [B,T,H,D] and k [B,T,Hkv,D]; in one application when k's heads
    directly follow q's in memory, as in the output of a joint q/k/v product (layers.py's
    ``linear_group``): a decode step of a small model is mostly such per-op costs."""
    if (q.dtype == k.dtype and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
            and q.stride() == k.stride() and q.stride(3) == 1 and q.stride(2) == q.shape[3]
            and k.storage_offset() == q.storage_offset() + q.shape[2] * q.shape[3]
            and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()):
        both = q.as_strided((*q.shape[:2], q.shape[2] + k.shape[2], q.shape[3]), q.stride())
        return apply_rotary(both, cos, sin).split([q.shape[2], k.shape[2]], dim=2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _gated(out: torch.Tensor, gate: list[torch.Tensor], keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The heads' output [B, T, H*D] at the positions ``keep`` (all without it), times the
    sigmoid output gate when the layer has one."""
    if keep is not None:
        out, gate = select_positions(out, keep), [select_positions(g, keep) for g in gate]
    return out * torch.sigmoid(gate[0]) if gate else out


@AttnFactory.register("gqa")
class GQA(nn.Module):
    """Grouped-query attention with optional per-head QK-norm and sigmoid output gate."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.resolved_head_dim
        self.use_qk_norm, self.use_gated_attention = config.use_qk_norm, config.use_gated_attention
        d, hd = config.dim, self.head_dim
        self.q_proj = Linear(d, self.n_heads * hd, bias=config.attn_bias)
        self.k_proj = Linear(d, self.n_kv_heads * hd, bias=config.attn_bias)
        self.v_proj = Linear(d, self.n_kv_heads * hd, bias=config.attn_bias)
        self.o_proj = Linear(self.n_heads * hd, d)
        if self.use_gated_attention:
            self.gate = Linear(d, self.n_heads * hd)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(hd, config.norm_eps)
            self.k_norm = RMSNorm(hd, config.norm_eps)

    @staticmethod
    def cache_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
        """Per-token shapes of what the KV cache stores: K and V, each [n_kv_heads, head_dim]."""
        return (config.n_kv_heads, config.resolved_head_dim), (config.n_kv_heads, config.resolved_head_dim)

    def joint_linears(self) -> list[tuple[nn.Module, ...]]:
        """The projections of the layer's input, read together by ``linear_group``."""
        gate = (self.gate,) if self.use_gated_attention else ()
        return [(self.q_proj, self.k_proj, self.v_proj, *gate)]

    def forward(self, x, rotary_emb, attn_mask=None, paged_cache=None, keep=None) -> torch.Tensor:
        """The attention output of every position, or with ``keep`` (see ``DecoderBlock``) of
        those positions only: K/V are still made and cached for all of them."""
        B, T, _ = x.shape
        q, k, v, *gate = linear_group(x, self.joint_linears()[0])
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate_pair(q, k, *rotary_emb)
        if paged_cache is not None:
            paged_cache.write(self.layer_idx, k, v)
            if paged_cache.shared_len:
                out = _attend_shared_prefix(q, paged_cache.gather_shared(self.layer_idx),
                                            paged_cache.gather(self.layer_idx, split=True), paged_cache.suffix_mask)
            else:
                k, v = paged_cache.gather(self.layer_idx)
                if paged_cache.row_spans is not None:
                    out = _attend_rows(q, k, v, paged_cache.attn_mask, paged_cache.row_spans, paged_cache.packed)
                else:
                    out = _attend(q, k, v, paged_cache.attn_mask, context_lens=paged_cache.context_lens)
        else:
            out = _attend(q, k, v, attn_mask)
        return self.o_proj(_gated(out.reshape(B, T, self.n_heads * self.head_dim), gate, keep))


@AttnFactory.register("mla")
class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2): K/V are rebuilt from a small latent.

    Only the normalised latent ``c_kv`` [kv_lora_rank] and the shared rotary key
    [qk_rope_head_dim] are cached per token, far less than full K/V.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.use_gated_attention = config.use_gated_attention
        d = config.dim
        self.q_proj = Linear(d, self.n_heads * self.head_dim)
        self.kv_a_proj = Linear(d, self.kv_lora_rank + self.qk_rope_head_dim)
        self.kv_norm = RMSNorm(self.kv_lora_rank, config.norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = Linear(self.n_heads * self.v_head_dim, d)
        if self.use_gated_attention:
            self.gate = Linear(d, self.n_heads * self.v_head_dim)

    @staticmethod
    def cache_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
        """The cache holds the latent [1, kv_lora_rank] as 'K' and the rotary key [1, rope_dim] as 'V'."""
        return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)

    def joint_linears(self) -> list[tuple[nn.Module, ...]]:
        """The projections of the layer's input, read together by ``linear_group``."""
        gate = (self.gate,) if self.use_gated_attention else ()
        return [(self.q_proj, self.kv_a_proj, *gate)]

    def forward(self, x, rotary_emb, attn_mask=None, paged_cache=None, keep=None) -> torch.Tensor:
        """As ``GQA.forward``: with ``keep``, the output of those positions only."""
        B, T, _ = x.shape
        H = self.n_heads
        q, latent, *gate = linear_group(x, self.joint_linears()[0])
        q = q.view(B, T, H, self.head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_norm(c_kv).unsqueeze(2)
        k_pe = k_pe.unsqueeze(2)
        cos, sin = rotary_emb
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin)
        if paged_cache is not None:
            paged_cache.write(self.layer_idx, c_kv, k_pe)
            c_kv, k_pe = paged_cache.gather(self.layer_idx)
            attn_mask = paged_cache.attn_mask
        S = c_kv.shape[1]
        kv = self.kv_b_proj(c_kv.squeeze(2)).view(B, S, H, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.expand(B, S, H, self.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return self.o_proj(_gated(_attend(q, k, v, attn_mask).reshape(B, T, H * self.v_head_dim), gate, keep))
