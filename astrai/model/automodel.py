"""AutoModel: the base of astrai's models, with model-type registry and save/load.

A model directory is Hugging Face-shaped: ``config.json`` plus ``model.safetensors``
(or shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``
above ``max_shard_bytes``). A quantized model (``astrai.model.quantized``) stores each
quantized linear as ``<name>.qweight`` and ``<name>.scales`` and says so in config.json's
``"quantization": {"format": "int8" | "int4" | "int4-asym", "group_size": 32}``; it opens as it is.
A tied model's table is stored once: as ``lm_head.qweight``/``scales`` when the head is quantized
(the embedding then looks up those blocks dequantized), else as the embedding's weight. A directory
written when a quantized head was an untied int8 copy (config.json's ``tie_weight`` false, the float
embedding stored beside it) opens as it was written. A directory whose config.json names a Hugging Face family
(llama, qwen2, qwen3, mistral) is converted on load by ``astrai.model.hf``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from safetensors import safe_open
from safetensors.torch import save_file

from astrai.config import ModelConfig
from astrai.errors import CheckpointError, ConfigError
from astrai.factory import BaseFactory

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
TIED_EMBEDDING = "embed_tokens.weight"  # looked up from a tied quantized head's blocks, so not stored


class AutoModel(nn.Module, BaseFactory["AutoModel"]):
    kind = "model type"

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config

    @classmethod
    def get_component_class(cls, model_type: str) -> type:
        return cls._registry.get(model_type)

    @classmethod
    def from_config(cls, config: ModelConfig) -> "AutoModel":
        config.validate()
        return AutoModel.get_component_class(config.model_type)(config)

    def num_parameters(self) -> int:
        """The logical parameter count, the same at every precision: tied weights counted once and
        quantized weights counted as the weights they hold (a tied quantized head is the embedding's table)."""
        from astrai.model.quantized import QuantizedLinear

        tied_head = getattr(self, "lm_head", None) if self.config.tie_weight else None
        packed = sum(m.out_features * (m.in_features + (m.bias is not None)) for m in self.modules()
                     if isinstance(m, QuantizedLinear) and m is not tied_head)
        return packed + sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    # --- saving -----------------------------------------------------------------
    def _unique_state_dict(self) -> dict[str, torch.Tensor]:
        """The state with a tied table stored once: the embedding's weight, or a quantized head's blocks."""
        state = self.state_dict()
        if self.config.tie_weight:
            state.pop("lm_head.weight", None)
            if "lm_head.qweight" in state:
                state.pop(TIED_EMBEDDING, None)
        return {k: v.detach().contiguous() for k, v in state.items()}

    def save_pretrained(self, save_directory: str | os.PathLike, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                        format: str = "astrai") -> Path:
        """Write config.json and safetensors weights (sharded above ``max_shard_bytes``).

        ``format`` "astrai" writes astrai's own layout; "llama", "qwen2", "qwen3" or
        "hf" (the fitting one of those) write a Hugging Face checkpoint instead (see
        ``astrai.model.hf.export_hf``). Files go to a temporary name first and are
        renamed into place, so an interrupted save leaves either the old files or the new ones.
        """
        quantization = getattr(self, "quantization", None)
        if format != "astrai":
            from astrai.model import hf

            if quantization:
                raise ConfigError(f"a {quantization['format']} quantized model cannot be exported to {format}; "
                                  "export the float model it was quantized from")

            return hf.export_hf(self, save_directory, "auto" if format == "hf" else format, max_shard_bytes)
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        write_safetensors(self._unique_state_dict(), out, max_shard_bytes,
                          {"format": "pt", "model_type": self.config.model_type})
        config = self.config.to_dict()
        if quantization:
            config["quantization"] = quantization
        _atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return out

    # --- loading ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, disable_random_init: bool = True,
                        dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu") -> "AutoModel":
        """Open an astrai or Hugging Face (Llama/Qwen2/Qwen3/Mistral) model directory, or a GGUF file."""
        from astrai.model import gguf, hf  # local imports: both import this module

        if gguf.is_gguf(path):
            return gguf.load_gguf_model(path, dtype=dtype, device=device)
        directory = Path(path)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: not a directory; expected a model directory with {CONFIG_NAME} and {WEIGHTS_NAME}")
        config_path = directory / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: missing; a model directory needs {CONFIG_NAME}")
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None
        model_type = raw.get("model_type", "transformer") if isinstance(raw, dict) else None
        if model_type in hf.HF_FAMILIES:
            return hf.load_hf_model(directory, raw, dtype=dtype, device=device)
        if model_type not in AutoModel._registry:
            known = ", ".join(AutoModel._registry.list_names() + sorted(hf.HF_FAMILIES))
            raise CheckpointError(f"{config_path}: unknown model_type {model_type!r}; known: {known}")
        quantization = checked_quantization(raw.pop("quantization", None), config_path)
        try:
            config = ModelConfig.from_dict(raw, source=str(config_path)).validate()
        except (ConfigError, TypeError) as exc:
            raise CheckpointError(str(exc)) from None
        origins: dict[str, Path] = {}
        state = read_safetensors_dir(directory, origins)
        return build_and_load(AutoModel.get_component_class(model_type), config, state, directory, dtype, device,
                              random_init=not disable_random_init, origins=origins, quantization=quantization)


def checked_quantization(entry, config_path: Path) -> Optional[dict]:
    """config.json's ``quantization`` entry, refused unless it names a format astrai reads."""
    from astrai.model.quantized import FORMATS, GROUP_SIZE

    if entry is None:
        return None
    formats = (*FORMATS, "mixed")
    if not isinstance(entry, dict) or entry.get("format") not in formats or entry.get("group_size") != GROUP_SIZE:
        raise CheckpointError(f"{config_path}: quantization {entry!r} is not one astrai reads; expected "
                              f'{{"format": one of {", ".join(formats)}, "group_size": {GROUP_SIZE}}}')
    return entry


def build_and_load(model_cls, config: ModelConfig, state: dict[str, torch.Tensor], directory: Path,
                   dtype=None, device="cpu", random_init: bool = False, origins: Optional[dict] = None,
                   quantization: Optional[dict] = None) -> AutoModel:
    """Construct on the meta device (no wasted init), then load weights by assignment.

    ``origins`` maps a tensor name to the file (and original name) it was read from,
    so a shape mismatch names the file to fix. With ``quantization``, every linear whose
    ``qweight`` the state holds becomes a QuantizedLinear first.
    """
    if random_init:
        model = model_cls(config)
    else:
        with torch.device("meta"):
            model = model_cls(config)
        model = model.to_empty(device="cpu")
        model.rotary_embedding.reset_buffers()
    if quantization is not None:
        from astrai.model.quantized import install_quantized_layout

        install_quantized_layout(model, state, quantization, directory)
    expected = model.state_dict()
    if config.tie_weight:
        expected.pop("lm_head.weight", None)
        if "lm_head.qweight" in expected:  # the embedding is the head's blocks dequantized (tie_weights)
            expected.pop(TIED_EMBEDDING, None)
            state = {k: v for k, v in state.items() if k != TIED_EMBEDDING}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{directory}: weights missing for {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    if unexpected:
        raise CheckpointError(f"{directory}: unexpected weights {', '.join(unexpected[:5])}{' …' if len(unexpected) > 5 else ''}")
    for name, tensor in state.items():
        where = (origins or {}).get(name, directory)
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{where}: tensor '{name}' has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {tuple(expected[name].shape)}")
        if not expected[name].is_floating_point() and tensor.dtype != expected[name].dtype:
            raise CheckpointError(f"{where}: tensor '{name}' has dtype {tensor.dtype}, expected {expected[name].dtype}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)


def write_safetensors(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int, metadata: dict[str, str]) -> None:
    """``model.safetensors``, or numbered shards plus an index once the tensors exceed ``max_shard_bytes``.

    Stale weight files from an earlier save are removed first so a directory never
    mixes two saves.
    """
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in list(out.glob("model-*-of-*.safetensors")) + [out / INDEX_NAME, out / WEIGHTS_NAME]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        _atomic_save(shards[0], out / WEIGHTS_NAME, metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _atomic_save(shard, out / fname, metadata)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    _atomic_write_text(out / INDEX_NAME, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def weight_bytes(directory: str | os.PathLike) -> int:
    """Bytes of a model directory's weight files (model.safetensors or its shards) on disk."""
    directory = Path(directory)
    return sum(f.stat().st_size for f in [directory / WEIGHTS_NAME, *directory.glob("model-*-of-*.safetensors")]
               if f.is_file())


def read_safetensors_dir(directory: Path, origins: Optional[dict[str, Path]] = None) -> dict[str, torch.Tensor]:
    """All tensors of a directory's model.safetensors or its index-listed shards.

    ``origins``, when given, is filled with the file each tensor came from, so later
    errors (a wrong shape) can name it.
    """
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: malformed shard index ({exc})") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {INDEX_NAME} but missing")
    elif any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise CheckpointError(f"{directory}: only pickled weights (.bin/.pt) found; astrai reads safetensors only "
                              "(re-save with transformers' save_pretrained(safe_serialization=True))")
    else:
        raise CheckpointError(f"{directory}: no {WEIGHTS_NAME} (or {INDEX_NAME}) found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as reader:
                for key in reader.keys():
                    state[key] = reader.get_tensor(key)
                    if origins is not None:
                        origins[key] = f
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{f}: cannot read safetensors file ({exc})") from None
    return state


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
