"""``astrai preprocess``: raw JSONL → a tokenised dataset directory for training (flags: astrai/commands/preprocess.py)."""

from __future__ import annotations

import argparse
import json
import sys

from astrai.dataset.preprocess import PreprocessOptions, prompts_truncated_warning, run_preprocess


def run(args: argparse.Namespace) -> int:
    opts = PreprocessOptions(
        inputs=args.inputs, output=args.output, tokenizer=args.tokenizer, train_type=args.train_type,
        format=args.format, packing=args.packing, seq_len=args.seq_len, position_ids=args.position_ids,
        doc_mask=args.doc_mask, truncation=args.truncation, max_prompt_len=args.max_prompt_len,
        shard_size=args.shard_size, num_workers=args.num_workers, batch_size=args.batch_size,
        skip_bad=args.skip_bad, show_progress=not args.quiet)
    summary = run_preprocess(opts)
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    if summary.get("prompts_truncated"):
        print(prompts_truncated_warning(summary, opts), file=sys.stderr)
    print(f"wrote {args.output}: {summary['tokens']:,} tokens of {summary['written']:,} records in "
          f"{summary['shards']} shard(s) ({args.format}, {args.train_type}); train on it with "
          f"--data_root_path {args.output}")
    return 0
