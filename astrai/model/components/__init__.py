"""Building blocks of the Transformer, importable one by one."""

from astrai.model.components.attention import GQA, MLA, AttnFactory
from astrai.model.components.decoder_block import DecoderBlock
from astrai.model.components.ffn import MLP, DeepSeekMoE, FFNFactory
from astrai.model.components.layers import Embedding, Linear, RMSNorm, RotaryEmbedding

__all__ = ["AttnFactory", "DecoderBlock", "DeepSeekMoE", "Embedding", "FFNFactory", "GQA", "Linear", "MLA", "MLP",
           "RMSNorm", "RotaryEmbedding"]
