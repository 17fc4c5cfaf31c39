"""``astrai model``'s flags (the run: astrai/model/cli.py)."""

from __future__ import annotations

import argparse

from astrai.commands.engine import QUANTIZATION_FORMATS
from astrai.config import PRESETS

EXPORT_FORMATS = ("hf", "llama", "qwen2", "qwen3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="write a randomly initialised model directory from a preset")
    create.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    create.add_argument("--out", required=True, help="output model directory")
    create.add_argument("--vocab_size", type=int, help="override the preset's vocabulary size (match your tokenizer)")
    create.add_argument("--seed", type=int, default=0)
    info = sub.add_parser("info", help="print a model's configuration, logical parameter count and weight bytes on disk")
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
    quantize.add_argument("path", help="astrai or Hugging Face model directory, or a .gguf file; an already "
                                       "quantized one (an imported GGUF) is requantized from its blocks")
    quantize.add_argument("--to", required=True, choices=QUANTIZATION_FORMATS, help="block-wise format (GGUF Q8_0 / Q4_0 / Q4_1)")
    quantize.add_argument("--out", required=True, help="output model directory")
    quantize.add_argument("--calibration", default=None, metavar="FILE|none",
                          help="int4: text (.jsonl with 'text', or .txt) whose activations choose each block's "
                               "scale (default: the bundled sample data/pretrain/train.jsonl); "
                               "'none' keeps Q4_0's plain rule")
