"""``astrai tokenizer``: train a byte-level BPE tokenizer, or inspect one (flags: astrai/commands/tokenizer.py)."""

from __future__ import annotations

import argparse
import codecs
import json
import sys

from astrai.progress import Phase, on_terminal
from astrai.tokenize import AutoTokenizer


def _hex_bytes(error: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in error.object[error.start:error.end]), error.end


codecs.register_error("astrai_hex_bytes", _hex_bytes)


def readable_piece(data: bytes) -> str:
    """A token's text, with the bytes of an incomplete character written ``<0xE5><0xBA>``."""
    return data.decode("utf-8", errors="astrai_hex_bytes")


def run(args: argparse.Namespace) -> int:
    if args.action == "train":
        terminal = on_terminal(sys.stderr)
        more = f" and {len(args.inputs) - 1} more" if len(args.inputs) > 1 else ""
        # on a terminal the tokenizers library draws its own bars (reading, counting pairs, merging)
        with Phase(f"learn {args.vocab_size} tokens from {args.inputs[0]}{more}", show=not terminal):
            tokenizer = AutoTokenizer.train(args.inputs, args.vocab_size, args.special_tokens,
                                            show_progress=terminal, min_frequency=args.min_frequency)
        tokenizer.save_pretrained(args.out)
        print(f"wrote {args.out}: tokenizer.json and tokenizer_config.json, vocabulary {tokenizer.vocab_size}, "
              f"special tokens {' '.join(args.special_tokens)}")
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
