"""The model: config-driven decoder-only Transformer with GQA/MLA and MLP/MoE."""

from astrai.model.automodel import AutoModel
from astrai.model.components import (GQA, MLA, MLP, AttnFactory, DecoderBlock, DeepSeekMoE, Embedding, FFNFactory,
                                     Linear, RMSNorm, RotaryEmbedding)
from astrai.model.transformer import Transformer
from astrai.model.reward import RewardModel  # registers model_type 'reward' for AutoModel.from_pretrained
from astrai.model import gguf, hf  # register the GGUF and Hugging Face converters for AutoModel.from_pretrained

__all__ = ["AutoModel", "AttnFactory", "DecoderBlock", "DeepSeekMoE", "Embedding", "FFNFactory", "GQA", "Linear", "MLA",
           "MLP", "RMSNorm", "RewardModel", "RotaryEmbedding", "Transformer"]
