"""``astrai quickstart``'s run: from scratch (astrai/quickstart.py) or, with ``--base``, from a
pretrained model (astrai/quickstart_base.py, which builds on the first). The flags stay in
astrai/quickstart.py, which imports nothing heavy."""

from __future__ import annotations

import argparse

from astrai.errors import ConfigError
from astrai.quickstart import Settings, load_plan, print_outcome, run_quickstart
from astrai.quickstart_base import run_from_args


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0:
        raise ConfigError(f"--minutes must be positive, got {args.minutes}")
    if args.base is not None:
        return run_from_args(args)
    if args.finetune is not None:
        raise ConfigError("--finetune applies to a run from a pretrained model: add --base PATH")
    plan = load_plan(args.plan) if args.plan else {}
    out = args.out or Settings.out
    summary = run_quickstart(out=out, minutes=args.minutes, seed=args.seed, preset=args.preset,
                             vocab_size=args.vocab_size, corpus=args.corpus, progress=not args.no_progress, **plan)
    print_outcome(summary, out)
    return 0
