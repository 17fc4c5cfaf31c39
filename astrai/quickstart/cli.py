"""``astrai quickstart``'s run: from scratch (from_scratch.py) or, with ``--base``, from a
pretrained model (from_pretrained.py, which builds on the first). Its flags:
astrai/commands/quickstart.py."""

from __future__ import annotations

import argparse

from astrai.errors import ConfigError
from astrai.quickstart.from_pretrained import run_from_args
from astrai.quickstart.from_scratch import Settings, load_plan, print_outcome, run_quickstart


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0:
        raise ConfigError(f"--minutes must be positive, got {args.minutes}")
    if args.base is not None:
        return run_from_args(args)
    if args.finetune is not None:
        raise ConfigError("--finetune applies to a run from a pretrained model: add --base PATH")
    plan = load_plan(args.plan) if args.plan else {}
    if plan and args.precision != "auto" and args.precision != plan["precision"]:
        raise ConfigError(f"--precision {args.precision} disagrees with the plan's {plan['precision']!r}: "
                          "a plan repeats its run's precision")
    plan.setdefault("precision", args.precision)
    out = args.out or Settings.out
    summary = run_quickstart(out=out, minutes=args.minutes, seed=args.seed, preset=args.preset,
                             vocab_size=args.vocab_size, corpus=args.corpus, progress=not args.no_progress, **plan)
    print_outcome(summary, out)
    return 0
