"""Flags shared by the verbs that run the inference engine: generate, chat and serve."""

from __future__ import annotations

import argparse

# astrai/inference/placement.py's DTYPE_CHOICES and astrai/model/quantized.py's FORMATS
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATION_FORMATS = ("int8", "int4", "int4-asym")
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16")  # astrai/inference/cache/storage.py's KV_CACHE_DTYPES

SAMPLING_HELP = "default: the model's generation_config.json, else greedy"
# astrai/inference/speculative.py's SPECULATIVE_METHODS, DEFAULT_DRAFT_TOKENS and MAX_DRAFT_TOKENS
SPECULATIVE_METHODS = ("ngram", "draft")
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 7


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "Unset flags take the model directory's generation_config.json when it has one; "
                    "without one, decoding is greedy (temperature 0), so two runs of a model agree.")
    group.add_argument("--max-tokens", dest="max_tokens", type=int, default=None,
                       help="tokens to generate (default: generation_config's max_new_tokens, else 256)")
    group.add_argument("--temperature", type=float, default=None, help=f"0 = greedy ({SAMPLING_HELP})")
    group.add_argument("--top-p", dest="top_p", type=float, default=None)
    group.add_argument("--top-k", dest="top_k", type=int, default=None)
    group.add_argument("--min-p", dest="min_p", type=float, default=None)
    group.add_argument("--repetition-penalty", dest="repetition_penalty", type=float, default=None)
    group.add_argument("--frequency-penalty", dest="frequency_penalty", type=float, default=None)
    group.add_argument("--presence-penalty", dest="presence_penalty", type=float, default=None)
    group.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (a visible GPU, else the CPU), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="weights' dtype; auto: bfloat16 on GPUs with native bf16, else as saved")
    parser.add_argument("--quantize", choices=QUANTIZATION_FORMATS, default=None,
                        help="quantize the linears' weights as they load (block-wise, as GGUF Q8_0/Q4_0/Q4_1); "
                             "a quantized model directory needs no flag")
    parser.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="the KV cache's dtype (default: the model's); a 16-bit cache holds twice the tokens "
                             "and halves what decoding after a long context reads")


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "speculative decoding", "Draft a few tokens cheaply and check them in one step of the model: the output is "
                                "exactly what decoding without it gives, in fewer steps when the drafts are right.")
    group.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                       help="ngram: draft by prompt lookup (pays when the answer repeats the prompt); "
                            "draft: with --draft-model (default: off, or draft when --draft-model is given)")
    group.add_argument("--draft-model", dest="draft_model", metavar="DIR", default=None,
                       help="a smaller model with the same tokenizer, drafting for --speculative draft")
    group.add_argument("--draft-tokens", dest="draft_tokens", type=int, default=None,
                       help=f"the most tokens a row drafts per step (shorter after a rejection), "
                            f"1 to {MAX_DRAFT_TOKENS} (default {DEFAULT_DRAFT_TOKENS})")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, tokenizer.json) or a GGUF file")
    add_placement_arguments(parser)
    parser.add_argument("--max-batch-size", dest="max_batch_size", type=int, default=16)
    parser.add_argument("--max-seq-len", dest="max_seq_len", type=int, default=None)
    parser.add_argument("--num-pages", dest="num_pages", type=int, default=None)
    parser.add_argument("--page-size", dest="page_size", type=int, default=16)
    add_speculative_arguments(parser)
