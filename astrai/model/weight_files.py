"""Model directories on disk: config.json beside model.safetensors (or shards listed in
model.safetensors.index.json), written atomically, read back into a state dict, and loaded into a
model built on the meta device. AutoModel and the Hugging Face and GGUF converters all build on
this module, so none of them has to import another for its file handling."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from astrai.config import ModelConfig
from astrai.errors import CheckpointError
from astrai.model.quantized import install_quantized_layout

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
TIED_EMBEDDING = "embed_tokens.weight"  # looked up from a tied quantized head's blocks, so not stored


def build_and_load(model_cls, config: ModelConfig, state: dict[str, torch.Tensor], directory: Path,
                   dtype=None, device="cpu", random_init: bool = False, origins: Optional[dict] = None,
                   quantization: Optional[dict] = None) -> nn.Module:
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


def file_mappings() -> list[tuple[int, int]]:
    """The address ranges of files mapped into this process (Linux's /proc/self/maps; none elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):  # an inode and a path: a file
            low, high = fields[0].split("-")
            ranges.append((int(low, 16), int(high, 16)))
    return ranges


def release_weight_file(model: nn.Module) -> int:
    """Copy ``model``'s parameters and buffers that still view a mapped file (the weights
    ``build_and_load`` assigns without a copy) into memory of their own; the bytes copied.

    A mapping stays while any tensor views it, with every page read while loading resident:
    once serving has quantized, cast or re-laid the linears, the norms and the embedding alone
    would keep the whole file in memory beside the converted weights. Shared tensors (a tied
    head) stay shared."""
    ranges = file_mappings()
    copies: dict[int, torch.Tensor] = {}
    copied = 0
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or tensor.device.type != "cpu":
                    continue
                address = tensor.untyped_storage().data_ptr()
                if not any(low <= address < high for low, high in ranges):
                    continue
                if id(tensor) not in copies:
                    own = tensor.detach().clone()
                    copies[id(tensor)] = nn.Parameter(own, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else own
                    copied += tensor.nbytes
                table[name] = copies[id(tensor)]
    return copied


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
        atomic_save(shards[0], out / WEIGHTS_NAME, metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        atomic_save(shard, out / fname, metadata)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    atomic_write_text(out / INDEX_NAME, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


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


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
