"""DecoderBlock: pre-norm attention and feed-forward, each with a residual."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from astrai.config import ModelConfig
from astrai.model.components.attention import AttnFactory
from astrai.model.components.ffn import build_ffn
from astrai.model.components.layers import RMSNorm, select_positions


class DecoderBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = AttnFactory.create(config.attn_type, config, layer_idx)
        self.post_attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = build_ffn(config, layer_idx)

    def forward(self, x, rotary_emb, attention_mask=None, paged_cache=None, keep: Optional[torch.Tensor] = None):
        """The block's output for every position of ``x`` [B, T, dim], or with ``keep`` ([B] or
        [B, R] positions, as ``select_positions`` takes them) for those positions only.

        The model's last block gets ``keep`` when only some positions' logits are wanted (a
        prefill wants each prompt's last): every position's K/V is still made and cached,
        but the output projection, residual and feed-forward run on the kept rows only,
        sparing that layer's larger matmuls for the rest."""
        attended = self.attention(self.input_norm(x), rotary_emb, attention_mask, paged_cache, keep)
        x = (x if keep is None else select_positions(x, keep)) + attended
        return x + self.mlp(self.post_attention_norm(x))
