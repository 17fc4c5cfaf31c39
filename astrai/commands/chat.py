"""``astrai chat``'s flags (the run: astrai/inference/chat_cli.py)."""

from __future__ import annotations

import argparse

from astrai.commands.engine import add_engine_arguments, add_sampling_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(parser)
