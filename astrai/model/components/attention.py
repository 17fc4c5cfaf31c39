"""Attention: GQA and MLA, both through ``scaled_dot_product_attention``.

Without a cache, ``attn_mask`` is either None (plain causal) or a boolean mask built by
the Transformer. With ``paged_cache`` the layer hands its new K/V and its queries to that
object, the attention backend, once per layer: ``paged_cache.attend(layer_idx, q, k, v)``
stores the new K/V and returns the attention of ``q`` over the whole cached context. What
the cache holds per token is the layer's business (``cache_shapes``): MLA stores a latent
and passes ``expand`` to rebuild K and V from what the backend read back. The inference
engine supplies the backend (astrai/inference/cache/kvcache.py); the model never needs to
know how the context is laid out or which kernel reads it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from astrai.config import ModelConfig
from astrai.factory import BaseFactory
from astrai.model.components.layers import Linear, RMSNorm, apply_rotary, select_positions


class AttnFactory(BaseFactory[nn.Module]):
    """attn_type → attention class ('gqa', 'mla')."""

    kind = "attention type"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
           scale: Optional[float] = None) -> torch.Tensor:
    """q [B,T,H,D], k/v [B,S,Hkv,*] → [B,T,H,Dv]; Hkv divides H (grouped-query attention).

    ``attn_mask`` [B, 1, T, S] is boolean (True = may attend) or additive; without one the
    attention is causal (or, for one query, over everything). SDPA takes the K/V groups
    directly (``enable_gqa``), so no copy of K/V per query head is made.
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    causal = attn_mask is None and q.shape[2] > 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


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

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The linears that read the layer's input, in the order ``project`` returns them."""
        gate = (self.gate,) if self.use_gated_attention else ()
        return (self.q_proj, self.k_proj, self.v_proj, *gate)

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The input's projections (q, k, v and the gate's input when the layer has one)."""
        return [m(x) for m in self.input_projections()]

    def forward(self, x, rotary_emb, attn_mask=None, paged_cache=None, keep=None) -> torch.Tensor:
        """The attention output of every position, or with ``keep`` (see ``DecoderBlock``) of
        those positions only: K/V are still made and cached for all of them."""
        B, T, _ = x.shape
        q, k, v, *gate = self.project(x)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotary_emb
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v, attn_mask) if paged_cache is None else paged_cache.attend(self.layer_idx, q, k, v)
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

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The linears that read the layer's input, in the order ``project`` returns them."""
        gate = (self.gate,) if self.use_gated_attention else ()
        return (self.q_proj, self.kv_a_proj, *gate)

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The input's projections (q, the latent with the rotary key, and the gate's input)."""
        return [m(x) for m in self.input_projections()]

    def forward(self, x, rotary_emb, attn_mask=None, paged_cache=None, keep=None) -> torch.Tensor:
        """As ``GQA.forward``: with ``keep``, the output of those positions only."""
        B, T, _ = x.shape
        H = self.n_heads
        q, latent, *gate = self.project(x)
        q = q.view(B, T, H, self.head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_norm(c_kv).unsqueeze(2)
        cos, sin = rotary_emb
        q = torch.cat((q_nope, apply_rotary(q_pe, cos, sin)), dim=-1)
        k_pe = apply_rotary(k_pe.unsqueeze(2), cos, sin)
        if paged_cache is None:
            out = attend(q, *self.expand(c_kv, k_pe), attn_mask)
        else:
            out = paged_cache.attend(self.layer_idx, q, c_kv, k_pe, expand=self.expand)
        return self.o_proj(_gated(out.reshape(B, T, H * self.v_head_dim), gate, keep))

    def expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, S, H, *] of every head from the cached latent [B, S, 1, rank] and the
        shared rotary key [B, S, 1, rope_dim]."""
        B, S = c_kv.shape[:2]
        H = self.n_heads
        kv = self.kv_b_proj(c_kv.squeeze(2)).view(B, S, H, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return torch.cat((k_nope, k_pe.expand(B, S, H, self.qk_rope_head_dim)), dim=-1), v
