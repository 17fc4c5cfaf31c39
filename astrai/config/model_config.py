"""ModelConfig: every shape of the Transformer in one JSON-serialisable dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from astrai.config.json_file import JsonConfig
from astrai.errors import ConfigError

ATTN_TYPES = ("gqa", "mla")
FFN_TYPES = ("mlp", "moe")
TOPK_METHODS = ("greedy", "sigmoid")
ROPE_SCALING_TYPES = ("linear", "ntk", "yarn", "llama3")
# Keys each rope_scaling type understands (a misspelt or Hugging Face-named key is an error, not ignored).
ROPE_SCALING_KEYS = {
    "linear": {"type", "factor"},
    "ntk": {"type", "factor"},
    "yarn": {"type", "factor", "original_max_len", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"type", "factor", "original_max_len", "low_freq_factor", "high_freq_factor"},
}


@dataclass
class ModelConfig(JsonConfig):
    """Shapes and options of astrai's decoder-only Transformer.

    The first block of fields is the spec's class diagram; the rest is what MLA, MoE,
    rotary scaling and Hugging Face interchange need. ``head_dim`` defaults to
    ``dim // n_heads`` (some imported families, e.g. Qwen3, set it explicitly).
    """

    vocab_size: int = 8192
    dim: int = 256
    n_layers: int = 4
    norm_eps: float = 1e-6
    dim_ffn: int = 768
    tie_weight: bool = True
    max_len: int = 2048
    rope_theta: float = 10000.0
    n_heads: int = 4
    n_kv_heads: int = 2
    use_qk_norm: bool = False
    use_gated_attention: bool = False
    attn_type: str = "gqa"
    ffn_type: str = "mlp"
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    n_activated_experts: int = 0
    moe_topk_method: str = "greedy"

    model_type: str = "transformer"
    head_dim: Optional[int] = None
    attn_bias: bool = False
    # MLA (DeepSeek-V2 style compressed latent KV)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    moe_dim_ffn: int = 0
    n_dense_layers: int = 0
    aux_loss_coef: float = 0.01
    norm_topk_prob: bool = True
    # RoPE scaling, e.g. {"type": "yarn", "factor": 4.0, "original_max_len": 2048}
    rope_scaling: Optional[dict] = None
    init_std: float = 0.02

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim else self.dim // self.n_heads

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.ffn_type == "moe" and layer_idx >= self.n_dense_layers

    def validate(self) -> "ModelConfig":
        """Raise ConfigError naming the first bad field; return self when all is well."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "dim", "n_layers", "dim_ffn", "max_len", "n_heads", "n_kv_heads"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        need(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        need(self.attn_type in ATTN_TYPES, f"unknown attn_type '{self.attn_type}'; choose one of {', '.join(ATTN_TYPES)}")
        need(self.ffn_type in FFN_TYPES, f"unknown ffn_type '{self.ffn_type}'; choose one of {', '.join(FFN_TYPES)}")
        need(self.n_heads % self.n_kv_heads == 0, f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None:
            need(self.dim % self.n_heads == 0, f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) unless head_dim is set")
        else:
            need(self.head_dim > 0, f"head_dim must be positive, got {self.head_dim}")
        if self.attn_type == "gqa":
            need(self.resolved_head_dim % 2 == 0, f"head_dim ({self.resolved_head_dim}) must be even for rotary embeddings")
        if self.attn_type == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                need(getattr(self, name) > 0, f"attn_type 'mla' needs {name} > 0, got {getattr(self, name)}")
            need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
        if self.ffn_type == "moe":
            need(self.n_routed_experts > 0, "ffn_type 'moe' needs n_routed_experts > 0")
            need(0 < self.n_activated_experts <= self.n_routed_experts,
                 f"n_activated_experts ({self.n_activated_experts}) must be in 1..n_routed_experts ({self.n_routed_experts})")
            need(self.n_shared_experts >= 0, "n_shared_experts must be >= 0")
            need(self.moe_topk_method in TOPK_METHODS, f"unknown moe_topk_method '{self.moe_topk_method}'; choose one of {', '.join(TOPK_METHODS)}")
            need(0 <= self.n_dense_layers <= self.n_layers, f"n_dense_layers ({self.n_dense_layers}) must be in 0..n_layers")
            need(self.aux_loss_coef >= 0, "aux_loss_coef must be >= 0")
        if self.rope_scaling is not None:
            need(isinstance(self.rope_scaling, dict), "rope_scaling must be a dict like {'type': 'linear', 'factor': 2.0}")
            kind = self.rope_scaling.get("type")
            need(kind in ROPE_SCALING_TYPES, f"unknown rope_scaling type {kind!r}; choose one of {', '.join(ROPE_SCALING_TYPES)}")
            factor = self.rope_scaling.get("factor")
            need(isinstance(factor, (int, float)) and factor >= 1.0, f"rope_scaling factor must be a number >= 1, got {factor!r}")
            unknown = sorted(set(self.rope_scaling) - ROPE_SCALING_KEYS[kind])
            need(not unknown, f"rope_scaling type '{kind}' does not use {', '.join(unknown)}; "
                              f"known keys: {', '.join(sorted(ROPE_SCALING_KEYS[kind]))}")
            if kind == "llama3":
                low, high = self.rope_scaling.get("low_freq_factor", 1.0), self.rope_scaling.get("high_freq_factor", 4.0)
                need(high > low, f"rope_scaling llama3 needs high_freq_factor ({high}) > low_freq_factor ({low})")
        return self


def _presets() -> dict[str, dict[str, Any]]:
    tiny = dict(vocab_size=8192, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, dim_ffn=768, max_len=1024)
    return {
        # ~5M parameters: tests and the CPU quick start.
        "tiny": tiny,
        "tiny-mla": dict(tiny, attn_type="mla", kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64),
        "tiny-moe": dict(tiny, ffn_type="moe", n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
                         moe_dim_ffn=256, n_dense_layers=1),
        # ~40M parameters.
        "small": dict(vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, dim_ffn=1536, max_len=2048),
        # ~1.04B parameters, bilingual 64k vocabulary.
        "1b": dict(vocab_size=65536, dim=2048, n_layers=20, n_heads=16, n_kv_heads=4, dim_ffn=5632, max_len=4096,
                   rope_theta=500000.0, use_qk_norm=True),
    }


PRESETS = _presets()


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named configuration (tiny, tiny-mla, tiny-moe, small, 1b) with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; choose one of {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides}, source=f"preset '{name}'").validate()
