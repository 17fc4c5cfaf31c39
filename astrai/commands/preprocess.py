"""``astrai preprocess``'s flags (the run: astrai/dataset/cli.py)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="JSONL files (text / messages / preference pairs / scored responses)")
    parser.add_argument("--output", "-o", required=True, help="output dataset directory")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (or model directory) or tokenizer.json")
    parser.add_argument("--train_type", default="seq", choices=["seq", "sft", "dpo", "grpo"])
    parser.add_argument("--format", default="mmap", choices=["mmap", "h5", "json"])
    parser.add_argument("--packing", default="concat", choices=["concat", "none", "best_fit"],
                        help="seq/sft: concat = one stream; none = one document per row; best_fit = rows filled "
                             "with whole documents (needs --seq_len)")
    parser.add_argument("--seq_len", type=int, help="row length: the training window for none/best_fit, "
                                                     "the pair length for dpo, prompt+response length for grpo")
    parser.add_argument("--position_ids", default="auto", choices=["auto", "continuous", "reset"],
                        help="reset = positions restart at each document (auto: reset for best_fit)")
    parser.add_argument("--doc_mask", default="auto", choices=["auto", "on", "off"],
                        help="store document ids so attention stays within documents (auto: on for best_fit)")
    parser.add_argument("--truncation", default="right", choices=["right", "left"],
                        help="which end of a too-long example to cut (right keeps the beginning)")
    parser.add_argument("--max_prompt_len", type=int, help="grpo: prompt width (default seq_len // 2)")
    parser.add_argument("--shard_size", type=int, default=16_000_000, help="tokens per shard")
    parser.add_argument("--num_workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--batch_size", type=int, default=512, help="lines per tokenizer call")
    parser.add_argument("--skip_bad", action="store_true", help="skip malformed lines (counted) instead of stopping")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
