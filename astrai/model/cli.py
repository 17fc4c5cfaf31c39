"""``astrai model``: create, describe, import, export or quantize model directories."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from astrai.config import PRESETS, preset
from astrai.model.quantized import FORMATS

# Files beside the weights that belong to the model directory and travel with a conversion.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
EXPORT_FORMATS = ("hf", "llama", "qwen2", "qwen3")
# text whose activations calibrate int4 scales by default: the repository's bilingual pre-training sample
BUNDLED_CALIBRATION = Path(__file__).resolve().parents[2] / "data" / "pretrain" / "train.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="write a randomly initialised model directory from a preset")
    create.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    create.add_argument("--out", required=True, help="output model directory")
    create.add_argument("--vocab_size", type=int, help="override the preset's vocabulary size (match your tokenizer)")
    create.add_argument("--seed", type=int, default=0)
    info = sub.add_parser("info", help="print a model directory's configuration and parameter count")
    info.add_argument("path")
    imp = sub.add_parser("import", help="convert a Hugging Face Llama/Qwen2/Qwen3/Mistral directory or GGUF file to astrai's format")
    imp.add_argument("path", help="Hugging Face model directory (config.json + safetensors) or a .gguf file")
    imp.add_argument("--out", required=True, help="output astrai model directory")
    exp = sub.add_parser("export", help="write an astrai model directory in a Hugging Face format transformers loads")
    exp.add_argument("path", help="astrai model directory")
    exp.add_argument("--out", required=True, help="output Hugging Face model directory")
    exp.add_argument("--format", default="hf", choices=EXPORT_FORMATS,
                     help="hf picks llama, qwen2 (q/k/v bias) or qwen3 (QK-norm) to fit the model")
    quantize = sub.add_parser("quantize", help="write an int8 or int4 weight-only quantized copy of a model")
    quantize.add_argument("path", help="astrai or Hugging Face model directory, or a .gguf file")
    quantize.add_argument("--to", required=True, choices=tuple(FORMATS), help="block-wise format (GGUF Q8_0 / Q4_0 / Q4_1)")
    quantize.add_argument("--out", required=True, help="output model directory")
    quantize.add_argument("--calibration", default=None, metavar="FILE|none",
                          help="int4: text (.jsonl with 'text', or .txt) whose activations choose each block's "
                               "scale (default: the bundled sample data/pretrain/train.jsonl); "
                               "'none' keeps Q4_0's plain rule")


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
