"""``astrai model``: create, describe, import, export or quantize model directories (flags: astrai/commands/model.py)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from astrai.config import preset
from astrai.errors import ConfigError
from astrai.model import AutoModel
from astrai.model.calibration import CALIBRATION_TOKENS, calibrate, calibration_windows
from astrai.model.gguf import is_gguf, load_gguf_model
from astrai.model.quantized import dequantize_model, quantization_targets, quantize_model
from astrai.model.weight_files import weight_bytes
from astrai.progress import Phase
from astrai.tokenize import AutoTokenizer

# Files beside the weights that belong to the model directory and travel with a conversion.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# text whose activations calibrate int4 scales by default: the repository's bilingual pre-training sample
BUNDLED_CALIBRATION = Path(__file__).resolve().parents[2] / "data" / "pretrain" / "train.jsonl"


def _copy_companions(source: str, destination: str) -> list[str]:
    copied = []
    for name in COMPANION_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(destination) / name)
            copied.append(name)
    return copied


def _save_with_tokenizer(model, source: str, out: str) -> str:
    """Write ``model`` to ``out`` with its tokenizer: a GGUF's from its metadata, a directory's copied."""
    if is_gguf(source):
        tokenizer = AutoTokenizer.from_pretrained(source)  # first: an unsupported tokenizer stops before any write
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return " (+ tokenizer and chat template)"
    model.save_pretrained(out)
    copied = _copy_companions(source, out)
    return f" (+ {', '.join(copied)})" if copied else ""


def _calibration(model, args: argparse.Namespace):
    """(importance or None, a note for the summary line) for ``astrai model quantize``."""
    choice = args.calibration
    if args.to != "int4":
        if choice not in (None, "none"):
            raise ConfigError(f"--calibration applies to int4; --to {args.to} has no scale to choose")
        return None, ""
    if choice == "none":
        return None, " (Q4_0's plain scales)"
    path = Path(choice) if choice else BUNDLED_CALIBRATION
    if not path.is_file():
        if choice:
            raise ConfigError(f"--calibration {choice}: no such file")
        return None, " (Q4_0's plain scales: no bundled calibration text here; pass --calibration FILE)"
    tokenizer = AutoTokenizer.from_pretrained(args.path)
    _, windows = calibration_windows(model, CALIBRATION_TOKENS)
    with Phase(f"calibrate on {path.name}", total=windows, unit="window") as step:
        importance = calibrate(model, tokenizer, path, progress=step)
    return importance, f" (scales calibrated on {path.name})"


def _size(model, out: str) -> str:
    """The summary's sizes: logical parameters (the same at every precision) and the weights' bytes on disk."""
    return f"{model.num_parameters():,} parameters, {weight_bytes(out) / 1e6:,.1f} MB of weights"


def _open(path: str, keep_quantized: bool = False):
    """The model at ``path`` (a directory or a GGUF file), read as one phase of progress."""
    if not is_gguf(path):
        with Phase(f"read {path}"):
            return AutoModel.from_pretrained(path)
    with Phase(f"read {path}", unit="tensor") as step:  # Q8_0/Q4_0/Q4_1 linears kept as int8/int4/int4-asym
        return load_gguf_model(path, keep_quantized=keep_quantized, progress=step)


def _quantize(args: argparse.Namespace) -> None:
    model = _open(args.path, keep_quantized=True)
    source = model.quantization["format"] if getattr(model, "quantization", None) else None
    if source:
        dequantize_model(model)  # requantized from the numbers its blocks hold
    importance, how = _calibration(model, args)
    with Phase(f"quantize to {args.to}", total=len(list(quantization_targets(model, 4))), unit="linear") as step:
        model = quantize_model(model, args.to, importance=importance, progress=step)
    with Phase(f"write {args.out}"):
        extra = _save_with_tokenizer(model, args.path, args.out)
    again = f", requantized from its {source} blocks" if source else ""
    print(f"wrote {args.out}: {_size(model, args.out)}, {args.to} weights{how}{again}{extra}")


def run(args: argparse.Namespace) -> int:
    if args.action == "create":
        torch.manual_seed(args.seed)
        overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
        model = AutoModel.from_config(preset(args.preset, **overrides))
        model.save_pretrained(args.out)
        print(f"wrote {args.out}: preset {args.preset}, {model.num_parameters():,} parameters")
    elif args.action == "import" and is_gguf(args.path):
        model = _open(args.path, keep_quantized=True)
        with Phase(f"write {args.out}"):
            extra = _save_with_tokenizer(model, args.path, args.out)
        kept = f", {model.quantization['format']} weights kept" if getattr(model, "quantization", None) else ""
        print(f"wrote {args.out}: {_size(model, args.out)}{kept}{extra}")
    elif args.action == "quantize":
        _quantize(args)
    elif args.action in ("import", "export"):
        model = _open(args.path)
        with Phase(f"write {args.out}"):
            model.save_pretrained(args.out, format="astrai" if args.action == "import" else args.format)
            copied = _copy_companions(args.path, args.out)
        extra = f" (+ {', '.join(copied)})" if copied else ""
        print(f"wrote {args.out}: {_size(model, args.out)}{extra}")
    else:
        model = _open(args.path, keep_quantized=True)
        for key, value in model.config.to_dict().items():
            print(f"{key:>22}: {value}")
        print(f"{'parameters':>22}: {model.num_parameters():,}")
        on_disk = Path(args.path).stat().st_size if is_gguf(args.path) else weight_bytes(args.path)
        print(f"{'weights on disk':>22}: {on_disk:,} bytes")
        if getattr(model, "quantization", None):
            print(f"{'quantization':>22}: {model.quantization}")
    return 0
