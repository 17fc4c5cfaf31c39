"""``astrai model``: create a model directory from a preset, or describe one."""

from __future__ import annotations

import argparse

from astrai.config import PRESETS, preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="write a randomly initialised model directory from a preset")
    create.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    create.add_argument("--out", required=True, help="output model directory")
    create.add_argument("--vocab_size", type=int, help="override the preset's vocabulary size (match your tokenizer)")
    create.add_argument("--seed", type=int, default=0)
    info = sub.add_parser("info", help="print a model directory's configuration and parameter count")
    info.add_argument("path")


def run(args: argparse.Namespace) -> int:
    import torch

    from astrai.model import AutoModel

    if args.action == "create":
        torch.manual_seed(args.seed)
        overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
        model = AutoModel.from_config(preset(args.preset, **overrides))
        model.save_pretrained(args.out)
        print(f"wrote {args.out}: preset {args.preset}, {model.num_parameters():,} parameters")
    else:
        model = AutoModel.from_pretrained(args.path)
        for key, value in model.config.to_dict().items():
            print(f"{key:>22}: {value}")
        print(f"{'parameters':>22}: {model.num_parameters():,}")
    return 0
