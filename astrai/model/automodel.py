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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from astrai.config import ModelConfig
from astrai.errors import CheckpointError, ConfigError
from astrai.factory import BaseFactory
from astrai.model.quantized import FORMATS, GROUP_SIZE, QuantizedLinear
from astrai.model.weight_files import (CONFIG_NAME, DEFAULT_SHARD_BYTES, TIED_EMBEDDING, WEIGHTS_NAME,
                                       atomic_write_text, build_and_load, read_safetensors_dir, write_safetensors)


@dataclass
class ForeignFormats:
    """The checkpoints AutoModel converts instead of reading as its own: GGUF files and Hugging Face
    directories. Their converters (astrai/model/gguf.py, hf.py) build on this module and register here
    when imported (astrai/model/__init__.py imports them), so this module imports neither."""

    file_loaders: list[tuple[Callable[..., bool], Callable[..., nn.Module]]] = field(default_factory=list)
    family_loaders: dict[str, Callable[..., nn.Module]] = field(default_factory=dict)  # config.json model_type
    exporter: Optional[Callable[..., Path]] = None


FOREIGN_FORMATS = ForeignFormats()


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
            if quantization:
                raise ConfigError(f"a {quantization['format']} quantized model cannot be exported to {format}; "
                                  "export the float model it was quantized from")

            return FOREIGN_FORMATS.exporter(self, save_directory, "auto" if format == "hf" else format, max_shard_bytes)
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        write_safetensors(self._unique_state_dict(), out, max_shard_bytes,
                          {"format": "pt", "model_type": self.config.model_type})
        config = self.config.to_dict()
        if quantization:
            config["quantization"] = quantization
        atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return out

    # --- loading ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, disable_random_init: bool = True,
                        dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu") -> "AutoModel":
        """Open an astrai or Hugging Face (Llama/Qwen2/Qwen3/Mistral) model directory, or a GGUF file."""
        for recognises, load in FOREIGN_FORMATS.file_loaders:
            if recognises(path):
                return load(path, dtype=dtype, device=device)
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
        if model_type in FOREIGN_FORMATS.family_loaders:
            return FOREIGN_FORMATS.family_loaders[model_type](directory, raw, dtype=dtype, device=device)
        if model_type not in AutoModel._registry:
            known = ", ".join(AutoModel._registry.list_names() + sorted(FOREIGN_FORMATS.family_loaders))
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
    if entry is None:
        return None
    formats = (*FORMATS, "mixed")
    if not isinstance(entry, dict) or entry.get("format") not in formats or entry.get("group_size") != GROUP_SIZE:
        raise CheckpointError(f"{config_path}: quantization {entry!r} is not one astrai reads; expected "
                              f'{{"format": one of {", ".join(formats)}, "group_size": {GROUP_SIZE}}}')
    return entry
