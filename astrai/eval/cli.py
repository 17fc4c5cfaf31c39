"""``astrai eval``: score a model directory and print/write the results as JSON (flags: astrai/commands/eval.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from astrai.errors import DataError
from astrai.eval.recorded import EVAL_CONFIG, LEAST, load_eval_config
from astrai.eval.suite import DEFAULT_HELDOUT, evaluate
from astrai.eval.task_accuracy import arithmetic_task
from astrai.inference.placement import resolve_device
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

DEFAULT_MAX_NEW_TOKENS = 48


def parse_heldout(values: list[str] | None) -> dict[str, Path]:
    if not values:
        return dict(DEFAULT_HELDOUT)
    heldout = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise DataError(f"--heldout {value!r}: expected NAME=FILE, e.g. en=data/pretrain/valid_en.jsonl")
        heldout[name] = Path(path)
    return heldout


def eval_settings(args: argparse.Namespace) -> dict:
    """Each evaluation setting (the names of ``recorded.LEAST``): its flag when given, else what
    the model directory's eval_config.json recorded, else None (the built-in default). Says on
    stderr which ones came from the file."""
    for name, least in LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise DataError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    recorded = load_eval_config(args.model)
    taken = {name: value for name, value in recorded.items() if getattr(args, name) is None}
    if taken:
        listed = ", ".join(f"{name}={value}" for name, value in taken.items())
        print(f"{Path(args.model) / EVAL_CONFIG}: {listed} (the settings the model was evaluated with; "
              f"a flag overrides each)", file=sys.stderr)
    return {name: getattr(args, name) if getattr(args, name) is not None else recorded.get(name) for name in LEAST}


def run(args: argparse.Namespace) -> int:
    settings = eval_settings(args)
    model = AutoModel.from_pretrained(args.model, device=resolve_device(args.device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    results = evaluate(
        model, tokenizer,
        heldout=None if args.no_perplexity else parse_heldout(args.heldout),
        ppl_window=settings["ppl_window"], ppl_stride=settings["ppl_stride"], ppl_max_tokens=settings["ppl_max_tokens"],
        task=None if settings["task_problems"] == 0 else arithmetic_task(settings["task_problems"]),
        samples=not args.no_samples, mmlu=args.mmlu, rouge=args.rouge, instructions=args.instructions,
        chat=not args.no_chat, max_new_tokens=settings["max_new_tokens"] or DEFAULT_MAX_NEW_TOKENS,
        task_max_new_tokens=settings["task_max_new_tokens"], progress=True,
    )
    text = json.dumps(results, indent=2, ensure_ascii=False)
    sys.stdout.write(text + "\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {args.out}: the results above as JSON", file=sys.stderr)
    return 0
