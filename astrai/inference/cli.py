"""``astrai generate``: complete prompts from the command line or a JSONL file.

Prompts come from ``--prompt`` (repeatable) or ``--input`` (JSONL; each line has
"prompt" text or chat "messages", plus optional per-line sampling fields such as
"max_tokens" or "temperature"). All requests are submitted at once, so the engine
batches them; results are written as JSONL (to ``--output`` or stdout) in input order.
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from astrai.errors import DataError, RequestError
from astrai.inference.placement import DTYPE_CHOICES, resolve_placement
from astrai.jsonl import iter_jsonl
from astrai.model.quantized import FORMATS

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "frequency_penalty", "presence_penalty", "seed")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=None, help="tokens to generate (default 256)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", dest="top_p", type=float, default=None)
    parser.add_argument("--top-k", dest="top_k", type=int, default=None)
    parser.add_argument("--min-p", dest="min_p", type=float, default=None)
    parser.add_argument("--repetition-penalty", dest="repetition_penalty", type=float, default=None)
    parser.add_argument("--frequency-penalty", dest="frequency_penalty", type=float, default=None)
    parser.add_argument("--presence-penalty", dest="presence_penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (a visible GPU, else the CPU), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="weights' dtype; auto: bfloat16 on GPUs with native bf16, else as saved")
    parser.add_argument("--quantize", choices=tuple(FORMATS), default=None,
                        help="quantize the linears' weights as they load (block-wise, as GGUF Q8_0/Q4_0/Q4_1); "
                             "a quantized model directory needs no flag")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, tokenizer.json) or a GGUF file")
    add_placement_arguments(parser)
    parser.add_argument("--max-batch-size", dest="max_batch_size", type=int, default=16)
    parser.add_argument("--max-seq-len", dest="max_seq_len", type=int, default=None)
    parser.add_argument("--num-pages", dest="num_pages", type=int, default=None)
    parser.add_argument("--page-size", dest="page_size", type=int, default=16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--input", help="JSONL file with one {'prompt': ...} or {'messages': [...]} per line")
    parser.add_argument("--output", help="JSONL file for the results (default: stdout)")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt texts as a user message with the chat template")
    add_sampling_arguments(parser)


def sampling_from_args(args: argparse.Namespace) -> dict:
    values = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    if args.stop:
        values["stop"] = list(args.stop)
    return {k: v for k, v in values.items() if v is not None}


def build_engine(args: argparse.Namespace):
    from astrai.inference.engine import InferenceEngine

    device, dtype = resolve_placement(args.device, args.dtype)
    return InferenceEngine.from_pretrained(args.model, device=device, dtype=dtype, quantize=getattr(args, "quantize", None),
                                           max_batch_size=args.max_batch_size,
                                           max_seq_len=args.max_seq_len, num_pages=args.num_pages,
                                           page_size=args.page_size)


def read_requests(args: argparse.Namespace) -> list[dict]:
    requests = [{"messages": [{"role": "user", "content": p}]} if args.chat else {"prompt": p} for p in args.prompt]
    if args.input:
        for where, record in iter_jsonl(args.input):
            if not isinstance(record, dict) or not (isinstance(record.get("prompt"), str) or isinstance(record.get("messages"), list)):
                raise DataError(f"{where}: expected an object with a 'prompt' string or a 'messages' list")
            requests.append(record)
    if not requests:
        raise RequestError("no prompts: give --prompt TEXT or --input FILE.jsonl")
    return requests


def run(args: argparse.Namespace) -> int:
    requests = read_requests(args)
    defaults = sampling_from_args(args)
    with build_engine(args) as engine:
        handles = []
        for i, record in enumerate(requests):
            overrides = {k: record[k] for k in (*SAMPLING_FLAGS, "stop") if k in record}
            try:
                params = engine.make_params(**{**defaults, **overrides})
                ids = engine.encode_prompt(record["messages"] if "messages" in record else record["prompt"])
                handles.append(engine.submit(ids, params))
            except RequestError as exc:
                raise RequestError(f"request {i + 1}: {exc}") from None
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
        try:
            for i, (record, handle) in enumerate(tqdm(list(zip(requests, handles)), desc="generate", file=sys.stderr,
                                                       disable=len(handles) < 2)):
                result = handle.result()
                row = {"index": i, **{k: record[k] for k in ("prompt", "messages") if k in record},
                       "text": result.text, "finish_reason": result.finish_reason,
                       "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()
        finally:
            if out is not sys.stdout:
                out.close()
    return 0
