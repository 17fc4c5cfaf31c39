"""``astrai eval``'s flags (the run: astrai/eval/cli.py). The evaluation settings default to those
recorded in the model directory's eval_config.json (astrai/eval/recorded.py), then to the built-in ones."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--heldout", action="append", default=None, metavar="NAME=FILE",
                        help="held-out text (.txt or .jsonl with 'text') for perplexity; repeatable "
                             "(default: the bundled English and Chinese held-out files)")
    parser.add_argument("--no-perplexity", action="store_true", help="skip perplexity")
    parser.add_argument("--ppl-window", type=int, default=None,
                        help="perplexity window (default: the model's eval_config.json, else its max_len)")
    parser.add_argument("--ppl-stride", type=int, default=None,
                        help="window stride (default: eval_config.json's, else three quarters of the window)")
    parser.add_argument("--ppl-max-tokens", type=int, default=None,
                        help="stop each held-out file after about this many tokens, whole documents "
                             "(default: eval_config.json's, else every token)")
    parser.add_argument("--task-problems", type=int, default=None,
                        help="solve the first N problems of the arithmetic task's held-out pool "
                             "(default: eval_config.json's, else all of them; 0 skips the task)")
    parser.add_argument("--task-max-new-tokens", type=int, default=None,
                        help="longest answer to a task problem (default: eval_config.json's, else --max-new-tokens)")
    parser.add_argument("--no-samples", action="store_true", help="skip the fixed English/Chinese sample prompts")
    parser.add_argument("--mmlu", action="append", default=[], metavar="FILE",
                        help="multiple-choice questions (MMLU CSV or JSONL); repeatable")
    parser.add_argument("--rouge", default=None, metavar="FILE", help="JSONL of prompt + reference for ROUGE-1/2/L")
    parser.add_argument("--instructions", default=None, metavar="FILE",
                        help="JSONL of prompt + checks for instruction following")
    parser.add_argument("--no-chat", action="store_true",
                        help="feed prompts as plain text instead of through the chat template (pre-trained models)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="longest generated answer for the samples, ROUGE and instructions "
                             "(default: eval_config.json's, else 48)")
    parser.add_argument("--device", default="auto", help="auto (a visible GPU, else the CPU), cpu, cuda, cuda:1, ...; "
                        "weights stay in their saved dtype")
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")
