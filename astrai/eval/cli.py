"""``astrai eval``: score a model directory and print/write the results as JSON (flags: astrai/commands/eval.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from astrai.errors import DataError


def parse_heldout(values: list[str] | None) -> dict[str, Path]:
    from astrai.eval.runner import DEFAULT_HELDOUT

    if not values:
        return dict(DEFAULT_HELDOUT)
    heldout = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise DataError(f"--heldout {value!r}: expected NAME=FILE, e.g. en=data/pretrain/valid_en.jsonl")
        heldout[name] = Path(path)
    return heldout


def run(args: argparse.Namespace) -> int:
    if args.task_problems is not None and args.task_problems < 0:
        raise DataError(f"--task-problems must be >= 0, got {args.task_problems}")
    from astrai.eval.runner import evaluate
    from astrai.eval.task import arithmetic_task
    from astrai.inference.placement import resolve_device
    from astrai.model import AutoModel
    from astrai.tokenize import AutoTokenizer

    model = AutoModel.from_pretrained(args.model, device=resolve_device(args.device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    results = evaluate(
        model, tokenizer,
        heldout=None if args.no_perplexity else parse_heldout(args.heldout),
        ppl_window=args.ppl_window, ppl_stride=args.ppl_stride, ppl_max_tokens=args.ppl_max_tokens,
        task=None if args.task_problems == 0 else arithmetic_task(args.task_problems),
        samples=not args.no_samples, mmlu=args.mmlu, rouge=args.rouge, instructions=args.instructions,
        chat=not args.no_chat, max_new_tokens=args.max_new_tokens, progress=True,
    )
    text = json.dumps(results, indent=2, ensure_ascii=False)
    sys.stdout.write(text + "\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {args.out}: the results above as JSON", file=sys.stderr)
    return 0
