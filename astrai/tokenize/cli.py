"""``astrai tokenizer``: train a byte-level BPE tokenizer, or inspect one."""

from __future__ import annotations

import argparse
import codecs
import json

from astrai.tokenize.training import SPECIAL_TOKENS


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


def _hex_bytes(error: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in error.object[error.start:error.end]), error.end


codecs.register_error("astrai_hex_bytes", _hex_bytes)


def readable_piece(data: bytes) -> str:
    """A token's text, with the bytes of an incomplete character written ``<0xE5><0xBA>``."""
    return data.decode("utf-8", errors="astrai_hex_bytes")


def run(args: argparse.Namespace) -> int:
    from astrai.tokenize import AutoTokenizer

    if args.action == "train":
        tokenizer = AutoTokenizer.train(args.inputs, args.vocab_size, args.special_tokens,
                                        show_progress=True, min_frequency=args.min_frequency)
        tokenizer.save_pretrained(args.out)
        print(f"wrote {args.out}: vocabulary {tokenizer.vocab_size}, special tokens {args.special_tokens}")
    elif args.action == "encode":
        tokenizer = AutoTokenizer.from_pretrained(args.path)
        ids = tokenizer.encode(args.text)
        print(json.dumps({"ids": ids, "pieces": [readable_piece(tokenizer.token_bytes(i)) for i in ids]},
                         ensure_ascii=False))
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.path)
        print(f"vocab_size: {tokenizer.vocab_size}")
        print(f"bos/eos/pad: {tokenizer.bos_token}={tokenizer.bos_id} {tokenizer.eos_token}={tokenizer.eos_id} "
              f"pad={tokenizer.pad_id}")
        print(f"stop_ids: {tokenizer.stop_ids}")
        print("chat_template:\n" + tokenizer.chat_template.template_str)
    return 0
