"""``astrai generate``: complete prompts from the command line or a JSONL file (flags: astrai/commands/generate.py).

Prompts come from ``--prompt`` (repeatable) or ``--input`` (JSONL; each line has
"prompt" text or chat "messages", plus optional per-line sampling fields such as
"max_tokens" or "temperature"). All requests are submitted at once, so the engine
batches them. On the terminal the completions stream as text, in input order, as a
user of ``llama-cli`` expects; ``--json`` (or ``--output FILE``) writes one JSON line per
prompt instead, for programs. ``--json-schema FILE`` holds every completion to a JSON Schema
(as can a "json_schema", "regex" or "grammar" field of a JSONL line). ``--sft-records``
answers each chat's last user turn (a plain prompt as a user turn) and writes the exchanges as
SFT records instead: a model's own replies, the data a draft head learns to guess them from
(docs/training.md).

Unset sampling flags take the model's generation_config.json, and greedy decoding when
there is none: the engine's own default (temperature 1.0) would make fp32 and int8 copies of
one model disagree for a reason that has nothing to do with their weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, TextIO

from tqdm import tqdm

from astrai.errors import DataError, RequestError
from astrai.inference.constraints import CONSTRAINT_FIELDS
from astrai.inference.engine import InferenceEngine
from astrai.inference.handle import RequestHandle
from astrai.inference.placement import resolve_placement
from astrai.inference.types import SamplingParams
from astrai.jsonl import iter_jsonl
from astrai.progress import on_terminal

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "frequency_penalty", "presence_penalty", "seed")


def sampling_from_args(args: argparse.Namespace) -> dict:
    values = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    if args.stop:
        values["stop"] = list(args.stop)
    if getattr(args, "json_schema", None):
        values["json_schema"] = read_json_schema(args.json_schema)
    return {k: v for k, v in values.items() if v is not None}


def read_json_schema(path: str) -> dict:
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise DataError(f"--json-schema {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"--json-schema {path}: not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise DataError(f"--json-schema {path}: a JSON Schema is an object, got {type(schema).__name__}")
    return schema


def default_sampling(model: str) -> Optional[SamplingParams]:
    """Greedy when ``model`` has no generation_config.json; None lets the engine read the file."""
    if (Path(model) / "generation_config.json").is_file():
        return None
    return SamplingParams(temperature=0.0)


def speculative_settings(args: argparse.Namespace) -> dict:
    """The engine settings the speculative decoding flags give (none when they are unset)."""
    settings = {name: getattr(args, name, None) for name in ("speculative", "draft_model", "draft_tokens")}
    return {name: value for name, value in settings.items() if value is not None}


def build_engine(args: argparse.Namespace) -> InferenceEngine:
    device, dtype = resolve_placement(args.device, args.dtype)
    defaults = default_sampling(args.model)
    return InferenceEngine.from_pretrained(args.model, device=device, dtype=dtype, quantize=getattr(args, "quantize", None),
                                           max_batch_size=args.max_batch_size,
                                           max_seq_len=args.max_seq_len, num_pages=args.num_pages,
                                           page_size=args.page_size, kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
                                           **speculative_settings(args),
                                           **({"default_params": defaults} if defaults is not None else {}))


def read_requests(args: argparse.Namespace) -> list[dict]:
    sft_records = args.sft_records  # every prompt a chat: SFT records are exchanges
    requests = [{"messages": [{"role": "user", "content": p}]} if args.chat or sft_records else {"prompt": p}
                for p in args.prompt]
    if args.input:
        for where, record in iter_jsonl(args.input):
            if not isinstance(record, dict) or not (isinstance(record.get("prompt"), str) or isinstance(record.get("messages"), list)):
                raise DataError(f"{where}: expected an object with a 'prompt' string or a 'messages' list")
            if sft_records:
                messages = record["messages"] if "messages" in record else [{"role": "user", "content": record["prompt"]}]
                record = {k: v for k, v in record.items() if k != "prompt"}
                record["messages"] = until_last_user_turn(messages, where)
            requests.append(record)
    if not requests:
        raise RequestError("no prompts: give --prompt TEXT or --input FILE.jsonl")
    return requests


def until_last_user_turn(messages: list, where: str) -> list:
    """A chat's turns up to its last user turn: the exchange ``--sft-records`` answers anew."""
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise DataError(f"{where}: --sft-records answers a user turn, and these messages have none")
    return messages[:users[-1] + 1]


def sft_record(record: dict, reply: str) -> dict:
    """The exchange as an SFT record (astrai/dataset/records.py): the chat with the reply as its
    assistant turn."""
    return {"messages": [*record["messages"], {"role": "assistant", "content": reply}]}


def timing_line(handle: RequestHandle, completion_tokens: int) -> str:
    """Time to first token and decode speed of one finished request, as llama.cpp's summary gives them."""
    first, total = handle.time_to_first_token, handle.duration
    line = f"{handle.prompt_tokens} prompt tokens, {completion_tokens} generated in {total:.2f} s"
    if first is None:
        return line
    line += f"; time to first token {first * 1000:.0f} ms"
    if completion_tokens > 1 and total > first:
        line += f", {(completion_tokens - 1) / (total - first):.1f} tokens/s after it"
    return line


def stream_text(handle: RequestHandle, out: TextIO) -> int:
    """Write one request's text as it arrives; its completion token count."""
    for event in handle:
        if event.error:
            raise RuntimeError(f"generation failed: {event.error}")
        if event.text:
            out.write(event.text)
            out.flush()
        if event.finished:
            out.write("\n")
            return event.completion_tokens
    return 0


def write_json_lines(requests: list[dict], handles: list[RequestHandle], out: TextIO, verbose: bool,
                     sft_records: bool = False) -> None:
    for i, (record, handle) in enumerate(tqdm(list(zip(requests, handles)), desc="generate", file=sys.stderr,
                                               disable=len(handles) < 2 or not on_terminal(sys.stderr))):
        result = handle.result()
        row = sft_record(record, result.text) if sft_records else {
            "index": i, **{k: record[k] for k in ("prompt", "messages") if k in record},
            "text": result.text, "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
        out.flush()
        if verbose:
            print(f"[{i}] {timing_line(handle, result.completion_tokens)}", file=sys.stderr)


def write_text(handles: list[RequestHandle], out: TextIO, verbose: bool) -> None:
    for i, handle in enumerate(handles):
        if len(handles) > 1:
            out.write(f"--- {i + 1}/{len(handles)} ---\n")
        completion_tokens = stream_text(handle, out)
        if verbose:
            print(timing_line(handle, completion_tokens), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    requests = read_requests(args)
    defaults = sampling_from_args(args)
    with build_engine(args) as engine:
        handles = []
        for i, record in enumerate(requests):
            overrides = {k: record[k] for k in (*SAMPLING_FLAGS, "stop", *CONSTRAINT_FIELDS) if k in record}
            base = defaults  # a line's own language replaces --json-schema's
            if any(k in overrides for k in CONSTRAINT_FIELDS):
                base = {k: v for k, v in defaults.items() if k not in CONSTRAINT_FIELDS}
            try:
                params = engine.make_params(**{**base, **overrides})
                ids = engine.encode_prompt(record["messages"] if "messages" in record else record["prompt"])
                handles.append(engine.submit_waiting(ids, params, handles))  # a file longer than the queue
            except RequestError as exc:
                raise RequestError(f"request {i + 1}: {exc}") from None
        sft_records = args.sft_records
        if args.output:
            with open(args.output, "w", encoding="utf-8") as out:
                write_json_lines(requests, handles, out, args.verbose, sft_records)
            kind = "SFT records" if sft_records else "JSON lines"
            print(f"wrote {args.output}: {len(handles)} completion(s) as {kind}", file=sys.stderr)
        elif args.json or sft_records:
            write_json_lines(requests, handles, sys.stdout, args.verbose, sft_records)
        else:
            write_text(handles, sys.stdout, args.verbose)
    return 0
