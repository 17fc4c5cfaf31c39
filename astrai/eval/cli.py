"""``astrai eval``: score a model directory and print/write the results as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from astrai.errors import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--heldout", action="append", default=None, metavar="NAME=FILE",
                        help="held-out text (.txt or .jsonl with 'text') for perplexity; repeatable "
                             "(default: the bundled English and Chinese held-out files)")
    parser.add_argument("--no-perplexity", action="store_true", help="skip perplexity")
    parser.add_argument("--ppl-window", type=int, default=None, help="perplexity window (default: model max_len)")
    parser.add_argument("--ppl-stride", type=int, default=None, help="window stride (default: half the window)")
    parser.add_argument("--ppl-max-tokens", type=int, default=None,
                        help="stop each held-out file after about this many tokens (whole documents)")
    parser.add_argument("--task-problems", type=int, default=None,
                        help="solve the first N problems of the arithmetic task's held-out pool "
                             "(default: all of them; 0 skips the task)")
    parser.add_argument("--no-samples", action="store_true", help="skip the fixed English/Chinese sample prompts")
    parser.add_argument("--mmlu", action="append", default=[], metavar="FILE",
                        help="multiple-choice questions (MMLU CSV or JSONL); repeatable")
    parser.add_argument("--rouge", default=None, metavar="FILE", help="JSONL of prompt + reference for ROUGE-1/2/L")
    parser.add_argument("--instructions", default=None, metavar="FILE",
                        help="JSONL of prompt + checks for instruction following")
    parser.add_argument("--no-chat", action="store_true",
                        help="feed prompts as plain text instead of through the chat template (pre-trained models)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="auto", help="auto (a visible GPU, else the CPU), cpu, cuda, cuda:1, ...; "
                        "weights stay in their saved dtype")
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")


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
        chat=not args.no_chat, max_new_tokens=args.max_new_tokens,
    )
    text = json.dumps(results, indent=2, ensure_ascii=False)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    sys.stdout.write(text + "\n")
    return 0
