"""``astrai model``: create, describe, import, export or quantize model directories (flags: astrai/commands/model.py)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from astrai.config import preset

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
    from astrai.model.gguf import is_gguf

    if is_gguf(source):
        from astrai.tokenize import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)  # first: an unsupported tokenizer stops before any write
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return " (+ tokenizer and chat template)"
    model.save_pretrained(out)
    copied = _copy_companions(source, out)
    return f" (+ {', '.join(copied)})" if copied else ""


def _calibration(model, args: argparse.Namespace):
    """(importance or None, a note for the summary line) for ``astrai model quantize``."""
    from astrai.errors import ConfigError
    from astrai.model.calibration import calibrate
    from astrai.tokenize import AutoTokenizer

    choice = args.calibration
    if getattr(model, "quantization", None):
        return None, ""  # quantize_model refuses it next, before any text is read
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
    return calibrate(model, tokenizer, path), f" (scales calibrated on {path.name})"


def run(args: argparse.Namespace) -> int:
    import torch

    from astrai.model import AutoModel
    from astrai.model.gguf import is_gguf, load_gguf_model

    if args.action == "create":
        torch.manual_seed(args.seed)
        overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
        model = AutoModel.from_config(preset(args.preset, **overrides))
        model.save_pretrained(args.out)
        print(f"wrote {args.out}: preset {args.preset}, {model.num_parameters():,} parameters")
    elif args.action == "import" and is_gguf(args.path):
        model = load_gguf_model(args.path, keep_quantized=True)  # Q8_0/Q4_0/Q4_1 linears stay int8/int4/int4-asym
        extra = _save_with_tokenizer(model, args.path, args.out)
        kept = f", {model.quantization['format']} weights kept" if getattr(model, "quantization", None) else ""
        print(f"wrote {args.out}: {model.num_parameters():,} parameters{kept}{extra}")
    elif args.action == "quantize":
        from astrai.model.quantized import quantize_model

        model = AutoModel.from_pretrained(args.path)
        importance, how = _calibration(model, args)
        model = quantize_model(model, args.to, importance=importance)
        extra = _save_with_tokenizer(model, args.path, args.out)
        print(f"wrote {args.out}: {model.num_parameters():,} parameters, {args.to} weights{how}{extra}")
    elif args.action in ("import", "export"):
        model = AutoModel.from_pretrained(args.path)
        model.save_pretrained(args.out, format="astrai" if args.action == "import" else args.format)
        copied = _copy_companions(args.path, args.out)
        extra = f" (+ {', '.join(copied)})" if copied else ""
        print(f"wrote {args.out}: {model.num_parameters():,} parameters{extra}")
    else:
        model = AutoModel.from_pretrained(args.path)
        for key, value in model.config.to_dict().items():
            print(f"{key:>22}: {value}")
        print(f"{'parameters':>22}: {model.num_parameters():,}")
        if getattr(model, "quantization", None):
            print(f"{'quantization':>22}: {model.quantization}")
    return 0
