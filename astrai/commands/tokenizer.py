"""``astrai tokenizer``'s flags (the run: astrai/tokenize/cli.py)."""

from __future__ import annotations

import argparse

# astrai/tokenize/training.py's SPECIAL_TOKENS
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    train = sub.add_parser("train", help="train on .txt / .jsonl files and save tokenizer.json + tokenizer_config.json")
    train.add_argument("inputs", nargs="+", help=".txt files (line by line) or .jsonl files (text / messages / prompt fields)")
    train.add_argument("--out", required=True, help="output directory (e.g. the model directory)")
    train.add_argument("--vocab_size", type=int, default=8000)
    train.add_argument("--min_frequency", type=int, default=2, help="merges need a pair seen at least this often")
    train.add_argument("--special_tokens", nargs="*", default=SPECIAL_TOKENS,
                       help="special tokens (default: %(default)s)")
    encode = sub.add_parser("encode", help="print the ids and pieces of a text")
    encode.add_argument("path", help="tokenizer directory or tokenizer.json")
    encode.add_argument("text")
    info = sub.add_parser("info", help="print vocabulary size, special tokens and chat template")
    info.add_argument("path", help="tokenizer directory or tokenizer.json")
