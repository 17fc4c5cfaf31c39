"""Hugging Face interchange: open Llama/Qwen2/Qwen3/Mistral checkpoints, export Llama/Qwen2/Qwen3.

Why a conversion is needed at all: the families store the same Transformer under
other names (``model.layers.0.self_attn.q_proj`` ↔ ``layers.0.attention.q_proj``)
and other config keys (``hidden_size`` ↔ ``dim``, ``rope_parameters`` ↔
``rope_scaling``). The weights themselves need no reshaping: astrai's rotary layout
is the half-split one these checkpoints use, so Q/K rows are not permuted.

What cannot be represented exactly is refused with a ``CheckpointError`` (import) or
``ConfigError`` (export) rather than converted into a silently different model, with
two documented approximations that are exact inside the imported ``max_len``:

* Mistral/Qwen sliding-window attention: astrai attends to the full context, which
  equals sliding-window attention for sequences no longer than the window, so
  ``max_len`` is capped at the window.
* ``dynamic`` NTK rope scaling: Hugging Face leaves the frequencies unchanged up to
  ``max_position_embeddings`` and only grows the base beyond it; astrai imports it as
  unscaled RoPE with ``max_len = max_position_embeddings``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

from astrai.config import ModelConfig
from astrai.errors import CheckpointError, ConfigError
from astrai.model.automodel import FOREIGN_FORMATS
from astrai.model.transformer import Transformer
from astrai.model.weight_files import (DEFAULT_SHARD_BYTES, atomic_write_text, build_and_load, read_safetensors_dir,
                                       write_safetensors)

HF_FAMILIES: frozenset[str] = frozenset({"llama", "qwen2", "qwen3", "mistral"})
EXPORT_FAMILIES = ("llama", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}

# Per-layer parameter names: Hugging Face suffix → astrai suffix.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attention.q_proj.weight",
    "self_attn.k_proj.weight": "attention.k_proj.weight",
    "self_attn.v_proj.weight": "attention.v_proj.weight",
    "self_attn.o_proj.weight": "attention.o_proj.weight",
    "self_attn.q_proj.bias": "attention.q_proj.bias",
    "self_attn.k_proj.bias": "attention.k_proj.bias",
    "self_attn.v_proj.bias": "attention.v_proj.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
                 "lm_head.weight": "lm_head.weight"}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ASTRAI_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_to_astrai_name(name: str) -> Optional[str]:
    """astrai's name for a Hugging Face tensor; None for buffers to drop (old rotary caches).

    Unknown names pass through unchanged so the loader reports them as unexpected.
    """
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return name


def astrai_to_hf_name(name: str) -> str:
    inverse_globals = {v: k for k, v in _GLOBAL_NAMES.items()}
    if name in inverse_globals:
        return inverse_globals[name]
    match = _ASTRAI_LAYER.match(name)
    inverse_layer = {v: k for k, v in _LAYER_NAMES.items()}
    if match and match.group(2) in inverse_layer:
        return f"model.layers.{match.group(1)}.{inverse_layer[match.group(2)]}"
    raise ConfigError(f"parameter '{name}' has no Hugging Face counterpart")


# --- rotary scaling ------------------------------------------------------------------
def rope_from_hf(raw: dict[str, Any], source: str) -> tuple[float, Optional[dict], Optional[int]]:
    """(rope_theta, astrai rope_scaling, max_len cap); CheckpointError naming a missing or bad rope field."""
    try:
        return _rope_from_hf(raw, source)
    except KeyError as exc:
        raise CheckpointError(f"{source}: rope scaling is missing {exc}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: rope scaling has a bad value ({exc})") from None


def _rope_from_hf(raw: dict[str, Any], source: str) -> tuple[float, Optional[dict], Optional[int]]:
    """Reads both conventions: transformers ≥ 5 writes ``rope_parameters`` (with
    ``rope_theta`` inside); older files have top-level ``rope_theta`` and ``rope_scaling``
    keyed by ``type`` or ``rope_type``.
    """
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise CheckpointError(f"{source}: rope_parameters/rope_scaling must be JSON objects")
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor is not supported (astrai rotates the whole head)")
    max_pos = raw.get("max_position_embeddings")
    if kind == "default":
        return theta, None, None
    if kind == "dynamic":
        return theta, None, max_pos
    factor = params.get("factor")
    if kind == "linear":
        return theta, {"type": "linear", "factor": float(factor)}, None
    if kind == "llama3":
        return theta, {"type": "llama3", "factor": float(factor), "original_max_len": int(params["original_max_position_embeddings"]),
                       "low_freq_factor": float(params["low_freq_factor"]),
                       "high_freq_factor": float(params["high_freq_factor"])}, None
    if kind == "yarn":
        original = int(params.get("original_max_position_embeddings") or max_pos)
        scaling: dict[str, Any] = {"type": "yarn", "original_max_len": original,
                                   "factor": float(factor if factor is not None else max_pos / original)}
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if params.get(key) is not None:
                scaling[key] = float(params[key])
        if params.get("truncate") is False:
            scaling["truncate"] = False
        return theta, scaling, None
    raise CheckpointError(f"{source}: rope type {kind!r} is not supported; astrai imports default, linear, dynamic, yarn and llama3")


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Config keys for the rotary embedding in the legacy form that transformers 4.x and 5.x both read."""
    out: dict[str, Any] = {"rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if not scaling:
        return out
    kind = scaling["type"]
    hf: dict[str, Any] = {"rope_type": kind, "type": kind, "factor": float(scaling["factor"])}
    if kind == "llama3":
        hf.update(original_max_position_embeddings=int(scaling.get("original_max_len", config.max_len)),
                  low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                  high_freq_factor=float(scaling.get("high_freq_factor", 4.0)))
    elif kind == "yarn":
        hf["original_max_position_embeddings"] = int(scaling.get("original_max_len", config.max_len))
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"):
            if key in scaling:
                hf[key] = scaling[key]
    elif kind != "linear":
        raise ConfigError(f"rope_scaling type '{kind}' has no Hugging Face equivalent; "
                          "export supports linear, yarn and llama3 (or none)")
    out["rope_scaling"] = hf
    return out


# --- import ------------------------------------------------------------------------
def _sliding_window_cap(raw: dict[str, Any], family: str) -> Optional[int]:
    if family == "mistral":
        return raw.get("sliding_window", 4096)
    layer_types = raw.get("layer_types") or []
    if "sliding_attention" in layer_types or raw.get("use_sliding_window"):
        return raw.get("sliding_window", 4096)  # transformers' default window for Qwen2/Qwen3
    return None


def hf_to_config(raw: dict[str, Any], source: str) -> ModelConfig:
    """ModelConfig equivalent to a Hugging Face config.json, or CheckpointError naming the field."""
    family = raw["model_type"]

    def need(key: str) -> Any:
        if key not in raw:
            raise CheckpointError(f"{source}: {family} config is missing '{key}'")
        return raw[key]

    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (astrai uses SwiGLU with silu)")
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported")
    if family in ("llama", "qwen3", "mistral") and raw.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias=true ({family} puts a bias on o_proj too) is not supported")
    theta, scaling, rope_cap = rope_from_hf(raw, source)
    n_heads = need("num_attention_heads")
    max_len = int(raw.get("max_position_embeddings", 2048))
    for cap in (rope_cap, _sliding_window_cap(raw, family)):
        if cap:
            max_len = min(max_len, int(cap))
    fields = dict(
        model_type="transformer",
        vocab_size=need("vocab_size"), dim=need("hidden_size"), n_layers=need("num_hidden_layers"),
        dim_ffn=need("intermediate_size"), n_heads=n_heads, n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim"), norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_weight=bool(raw.get("tie_word_embeddings", False)), max_len=max_len,
        rope_theta=theta, rope_scaling=scaling, attn_bias=family == "qwen2", use_qk_norm=family == "qwen3",
        init_std=float(raw.get("initializer_range", 0.02)),
    )
    if fields["head_dim"] == fields["dim"] // n_heads:
        fields["head_dim"] = None
    try:
        return ModelConfig(**fields).validate()
    except ConfigError as exc:
        raise CheckpointError(f"{source}: {exc}") from None


def load_hf_model(directory: str | os.PathLike, raw_config: dict[str, Any], dtype: Optional[torch.dtype] = None,
                  device: str | torch.device = "cpu"):
    """An astrai Transformer holding the weights of a Hugging Face checkpoint directory."""
    directory = Path(directory)
    config = hf_to_config(raw_config, str(directory / "config.json"))
    hf_origins: dict[str, Path] = {}
    state: dict[str, torch.Tensor] = {}
    origins: dict[str, str] = {}
    for name, tensor in read_safetensors_dir(directory, hf_origins).items():
        new_name = hf_to_astrai_name(name)
        if new_name is not None:
            state[new_name] = tensor
            origins[new_name] = f"{hf_origins[name]} ('{name}')"
    if config.tie_weight:
        state.pop("lm_head.weight", None)
    return build_and_load(Transformer, config, state, directory, dtype, device, origins=origins)


# --- export ------------------------------------------------------------------------
def pick_family(config: ModelConfig) -> str:
    """The Hugging Face family that represents this config exactly."""
    if config.use_qk_norm and config.attn_bias:
        raise ConfigError("no Hugging Face family has both QK-norm and q/k/v bias; cannot export")
    if config.use_qk_norm:
        return "qwen3"
    return "qwen2" if config.attn_bias else "llama"


def hf_config(config: ModelConfig, family: str, dtype: torch.dtype) -> dict[str, Any]:
    """A Hugging Face config.json dict for ``config`` in ``family``; ConfigError when it does not fit."""
    if family not in EXPORT_FAMILIES:
        raise ConfigError(f"unknown export format '{family}'; choose one of {', '.join(EXPORT_FAMILIES)}")
    if config.attn_type != "gqa" or config.ffn_type != "mlp":
        raise ConfigError(f"only dense GQA models export to {family}; this one has attn_type "
                          f"'{config.attn_type}' and ffn_type '{config.ffn_type}'")
    if config.use_gated_attention:
        raise ConfigError(f"gated attention has no {family} equivalent; cannot export")
    if config.use_qk_norm != (family == "qwen3"):
        raise ConfigError(f"use_qk_norm={config.use_qk_norm} does not fit {family}; "
                          f"use format '{pick_family(config)}'")
    if config.attn_bias != (family == "qwen2"):
        raise ConfigError(f"attn_bias={config.attn_bias} does not fit {family}; use format '{pick_family(config)}'")
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.dim_ffn,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.resolved_head_dim,
        "hidden_act": "silu", "max_position_embeddings": config.max_len, "rms_norm_eps": config.norm_eps,
        "initializer_range": config.init_std, "tie_word_embeddings": config.tie_weight,
        "attention_bias": False, "attention_dropout": 0.0, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # Unknown to the model; null keeps transformers from assuming Llama's 1/2.
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    if family == "llama":
        out["mlp_bias"] = False
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    out.update(rope_to_hf(config))
    return out


def export_hf(model, save_directory: str | os.PathLike, family: str = "auto", max_shard_bytes: Optional[int] = None,
              token_ids: Optional[dict[str, int]] = None) -> Path:
    """Write ``model`` as a Hugging Face checkpoint (config.json + safetensors) that transformers loads.

    ``family`` is llama, qwen2, qwen3 or auto (llama unless the model has QK-norm →
    qwen3, or q/k/v bias → qwen2). ``token_ids`` may set bos_token_id / eos_token_id /
    pad_token_id in config.json (the tokenizer knows them, the model does not).
    """
    config: ModelConfig = model.config
    family = pick_family(config) if family == "auto" else family
    state = model._unique_state_dict()
    dtype = next(iter(state.values())).dtype
    hf = hf_config(config, family, dtype)
    unknown = sorted(set(token_ids or {}) - {"bos_token_id", "eos_token_id", "pad_token_id"})
    if unknown:
        raise ConfigError(f"token_ids: unknown key(s) {', '.join(unknown)}; use bos_token_id, eos_token_id, pad_token_id")
    hf.update(token_ids or {})
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors({astrai_to_hf_name(k): v for k, v in state.items()}, out,
                      max_shard_bytes or DEFAULT_SHARD_BYTES, {"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(hf, indent=2) + "\n")
    return out


def export_llama(model, save_directory: str | os.PathLike, max_shard_bytes: Optional[int] = None) -> Path:
    """Write ``model`` in the Llama format (LlamaForCausalLM); see ``export_hf``."""
    return export_hf(model, save_directory, family="llama", max_shard_bytes=max_shard_bytes)


FOREIGN_FORMATS.family_loaders.update(dict.fromkeys(HF_FAMILIES, load_hf_model))
FOREIGN_FORMATS.exporter = export_hf
