"""``astrai generate``'s flags (the run: astrai/inference/cli.py)."""

from __future__ import annotations

import argparse

from astrai.commands.engine import add_engine_arguments, add_sampling_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--input", help="JSONL file with one {'prompt': ...} or {'messages': [...]} per line")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line per prompt (text, finish_reason, token counts) instead of streaming "
                             "the text")
    parser.add_argument("--output", help="write the JSON lines to this file instead (the terminal then stays quiet)")
    parser.add_argument("--sft-records", dest="sft_records", action="store_true",
                        help="answer each chat's last user turn (later turns dropped; a plain prompt is a user turn) "
                             "and write SFT records {'messages': [..., the reply]}, what 'astrai preprocess "
                             "--train_type sft' reads: a model's own replies, to train a draft head on")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="on stderr: time to first token and tokens/s of each completion")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt texts as a user message with the chat template")
    parser.add_argument("--json-schema", dest="json_schema", metavar="FILE",
                        help="a JSON Schema file: every completion is JSON valid against it (constrained decoding)")
    add_sampling_arguments(parser)
