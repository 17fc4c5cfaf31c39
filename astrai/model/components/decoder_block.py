"""DecoderBlock: pre-norm attention and feed-forward, each with a residual."""

from __future__ import annotations

from torch import nn

from astrai.config import ModelConfig
from astrai.model.components.attention import AttnFactory
from astrai.model.components.ffn import build_ffn
from astrai.model.components.layers import RMSNorm


class DecoderBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = AttnFactory.create(config.attn_type, config, layer_idx)
        self.post_attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = build_ffn(config, layer_idx)

    def forward(self, x, rotary_emb, attention_mask=None, paged_cache=None):
        x = x + self.attention(self.input_norm(x), rotary_emb, attention_mask, paged_cache)
        return x + self.mlp(self.post_attention_norm(x))
