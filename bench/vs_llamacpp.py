"""Benchmark: astrai against llama.cpp on the same weights, alternated in one benchmark run.

llama.cpp is built from the source that llama-cpp-python's PyPI sdist vendors
(bench/build_llamacpp.sh); the models are made locally (bench/llamacpp_models.py):
SmolLM2-135M-Instruct and a random Llama 3.2 1B-shaped model, each as one Hugging Face
directory for astrai and GGUFs of the same weights for llama.cpp. For each model and each
precision pair (astrai fp32/bf16/int8/int4/int4-asym against llama.cpp F32/BF16/Q8_0/Q4_0/Q4_1), in
rounds that alternate the systems:

- decode: single-stream greedy, ``--new-tokens`` (128) after a 32-token prompt. astrai's
  rate counts the steps after the first token (the prompt's prefill excluded), as
  ``llama-bench -n 128 -d 32`` does. Quantized GGUFs run twice: with llama.cpp's
  default repacked weight buffers (what users get) and with ``--repack 0``.
  On SmolLM2 at fp32, transformers' ``generate`` runs in the same rounds.
- prefill: a 512-token prompt (astrai: its time to first token; ``llama-bench -p 512 -n 0``).
- depth (``--depths 512,2048,...``): single-stream decode with that many tokens already in the
  cache (``llama-bench -d``), both KV caches ``--kv-cache-dtype`` wide (llama.cpp's default is
  F16; the llama-bench of llama-cpp-python 0.3.36 refuses ``-ctk f32``, so like-for-like rows
  compare 16-bit caches); the bound beside each counts the KV bytes a step reads besides the
  weights'.
- server (SmolLM2): 64 streamed requests of mixed lengths sent at once to
  ``llama-server -np 16`` and to ``astrai serve --max-batch-size 16``: output tokens/s and
  time to first token (p50, p95).
- chat (SmolLM2, only when asked: ``--parts chat``): ``--chat-users`` (16) simulated users each
  holding a ``--chat-turns`` (6) turn conversation built from the bundled chat data
  (bench/chat_workload.py), every turn sent with its whole history, contexts growing to 2-4k
  tokens, 64 greedy tokens a reply. ``astrai serve --max-batch-size 16`` with a paged KV cache of
  16 x 4,096 tokens (``--num-pages`` x ``--page-size``) against ``llama-server -np 16 -c 65536``
  (``--server-slots`` x ``--chat-slot-tokens``) with ``cache_prompt``, both caches
  ``--kv-cache-dtype`` wide (F16 by default, llama.cpp's own default), at each
  ``--server-precisions``; each server starts afresh per round, astrai first in even rounds. Output tokens/s, time to first token p50/p95 over all
  turns (and p50 per turn) and the server's resident memory after the run (VmRSS, peak VmHWM).
  The full run: ``--models smollm2 --parts chat --server-precisions fp32,int8 --server-repeats 2``.

Beside each decode figure: the bound, the weights' bytes read per token (from the GGUF)
over the machine's streaming-read bandwidth (2 threads summing a 1 GiB buffer, no writes),
and each system's rate as a fraction of it. A precision astrai does not offer yet (the
engine refuses the ``quantize`` keyword) is reported as not available.

Usage: OMP_NUM_THREADS=2 .venv/bin/python bench/vs_llamacpp.py [--models smollm2,llama1b]
       [--precisions fp32,bf16,int8,int4] [--parts decode,prefill,server,depth,chat] [--repeats N] [--quick]
       [--depths 512,2048,4096,8000] [--kv-cache-dtype float32|bfloat16|float16]
       [--server-precisions fp32,int8] [--server-repeats N] [--chat-users N] [--chat-turns N] [--chat-slot-tokens N]
Writes a dated JSON file to bench/results/ (see results_file.py).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.backends.cpu import tune_process  # noqa: E402
from astrai.errors import AstraiError  # noqa: E402
from astrai.inference import InferenceEngine, SamplingParams  # noqa: E402
from astrai.tokenize import AutoTokenizer  # noqa: E402
from chat_workload import build_conversations, run_conversations  # noqa: E402
from generate import FirstTokenClock, hf_generate  # noqa: E402  (bench/ is on sys.path when a script runs)
from llamacpp_models import (GGUF_TYPES, MODELS, build_llamacpp, ensure_gguf, ensure_hf, locate_llamacpp,  # noqa: E402
                             tensor_types, weight_bytes_per_token)
from llamacpp_tools import ServerProcess, free_port, llama_bench, resident_memory  # noqa: E402
from results_file import write_result  # noqa: E402
from serving_load import mixed_requests, run_load  # noqa: E402

PARTS = ("decode", "prefill", "server", "depth", "chat")
DEFAULT_PARTS = ("decode", "prefill", "server", "depth")
# astrai's kv_cache_dtype -> llama.cpp's -ctk/-ctv type of the same width (its default is f16)
LLAMA_CACHE_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
PROMPT_TOKENS = 32
PROMPT_VOCAB = 49152  # both models carry SmolLM2's tokenizer; prompts stay inside it
QUANTIZED = ("int8", "int4", "int4-asym")
SERVED_NAME = "bench"
ASTRAI_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the chat part: astrai's KV cache holds as many tokens (in pages) as llama-server's slots together
CHAT_NEW_TOKENS = 64
CHAT_PAGE_SIZE = 16
CHAT_SEED = 0
CHAT_FIGURES = ("output_tok_s", "ttft_p50_s", "ttft_p95_s", "vm_rss_bytes", "vm_hwm_bytes")


class NotAvailable(Exception):
    """astrai does not offer this precision (yet)."""


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Streaming-read bandwidth in bytes/s: the best of ``repeats`` sums of a buffer far larger
    than any last-level cache, on ``threads`` threads; a sum reads and writes nothing back,
    the access pattern of a one-row matmul (GEMV)."""
    torch.set_num_threads(threads)
    buffer = torch.ones(nbytes // 4)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def open_astrai(model_dir: Path, precision: str, max_seq_len: int, **settings) -> InferenceEngine:
    """One-stream engine at ``precision``; NotAvailable when astrai refuses the quantize keyword."""
    settings = dict(max_batch_size=1, page_size=16, max_seq_len=max_seq_len, **settings)
    if precision in ASTRAI_DTYPES:
        return InferenceEngine.from_pretrained(model_dir, dtype=ASTRAI_DTYPES[precision], **settings)
    try:
        return InferenceEngine.from_pretrained(model_dir, quantize=precision, **settings)
    except (TypeError, AstraiError) as exc:
        if "quantize" in str(exc):
            raise NotAvailable(f"astrai has no quantize={precision!r} here ({type(exc).__name__}: {exc})") from None
        raise


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, PROMPT_VOCAB) for _ in range(n)]


def astrai_decode(engine: InferenceEngine, n_new: int, seed: int, depth: int = PROMPT_TOKENS,
                  fresh: bool = True) -> dict:
    """Greedy decode of ``n_new`` tokens after a ``depth``-token prompt; the rate counts the steps
    after the first token (the prompt's prefill excluded). ``fresh=False`` keeps the prefix
    cache, so a longer prompt of the same seed (``prompt_ids`` extends it) prefills only its
    new tokens."""
    if fresh:
        engine.scheduler.clear_prefix_cache()
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    handle = engine.submit(prompt_ids(depth, seed), params)
    tokens = handle.result().token_ids
    seconds = time.perf_counter() - start
    first = handle.time_to_first_token
    return {"tok_s": (len(tokens) - 1) / (seconds - first), "end_to_end_tok_s": len(tokens) / seconds,
            "tokens": len(tokens)}


def astrai_prefill(engine: InferenceEngine, n_prompt: int, seed: int) -> float:
    engine.scheduler.clear_prefix_cache()
    handle = engine.submit(prompt_ids(n_prompt, seed), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    handle.result()
    return n_prompt / handle.time_to_first_token


def transformers_decode(hf, n_new: int, seed: int) -> float:
    clock = FirstTokenClock()
    start = time.perf_counter()
    _, seconds = hf_generate(hf, [prompt_ids(PROMPT_TOKENS, seed)], n_new, streamer=clock)
    return (n_new - 1) / (seconds - (clock.first - start))


def load_transformers(model_dir: Path):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "best": max(samples), "samples": samples} if samples else {}


def without_depth(bench_args: list[str]) -> list[str]:
    at = bench_args.index("-d")
    return bench_args[:at] + bench_args[at + 2:]


def bench_rate(row: dict) -> float | None:
    return None if "error" in row else float(row["avg_ts"])


def run_pair(model: str, precision: str, llamacpp, args, bandwidth: float) -> dict:
    """All single-stream measurements of one (model, precision) pair, rounds alternating the systems."""
    gguf = ensure_gguf(model, GGUF_TYPES[precision], llamacpp)
    model_dir = ensure_hf(model)
    bench = llamacpp.tool("llama-bench")
    parts = args.parts
    weight_bytes = weight_bytes_per_token(gguf)
    out = {"model": model, "precision": precision, "gguf_type": GGUF_TYPES[precision], "gguf": gguf.name,
           "gguf_tensor_types": tensor_types(gguf), "weight_bytes_per_token": weight_bytes,
           "bound_tok_s": bandwidth / weight_bytes}
    # llama.cpp's configurations: (label, extra llama-bench arguments)
    configs = [("default", [])] + ([("repack0", ["--repack", "0"])] if precision in QUANTIZED else [])
    decode_args = ["-p", "0", "-n", str(args.new_tokens), "-d", str(PROMPT_TOKENS), "-r", "1"]
    prefill_args = ["-p", str(args.prefill_tokens), "-n", "0", "-r", "1"]
    samples: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    no_depth: dict[str, str] = {}  # decodes measured from an empty context, and why

    def add(key: str, value) -> None:
        samples.setdefault(key, []).append(value)

    def llama(key: str, bench_args: list[str]) -> None:
        if key in errors:
            return
        if key in no_depth:
            bench_args = without_depth(bench_args)
        row = llama_bench(bench, gguf, args.threads, bench_args)
        if "error" in row and "-d" in bench_args:
            # the prompt before a decode runs llama.cpp's batched path, which can crash where
            # its one-row path works (repacked buffers on some CPUs): decode from an empty context
            print(f"  llama.cpp {key}: {row['error']}; again without the {PROMPT_TOKENS}-token context", flush=True)
            no_depth[key] = row["error"]
            row = llama_bench(bench, gguf, args.threads, without_depth(bench_args))
        rate = bench_rate(row)
        if rate is None:
            errors[key] = row["error"]
            print(f"  llama.cpp {key}: {row['error']}", flush=True)
        else:
            add(key, rate)
            out.setdefault("llamacpp_build", {k: row.get(k) for k in ("build_commit", "build_number", "cpu_info",
                                                                       "backends")})

    started = time.perf_counter()
    try:
        engine = open_astrai(model_dir, precision, max_seq_len=max(args.prefill_tokens, PROMPT_TOKENS + args.new_tokens) + 16)
    except NotAvailable as exc:
        engine, out["astrai"] = None, f"not available: {exc}"
        print(f"[{model} {precision}] astrai: not available ({exc})", flush=True)
    out["astrai_load_s"] = time.perf_counter() - started
    hf = load_transformers(model_dir) if (model == "smollm2" and precision == "fp32" and "decode" in parts
                                          and not args.no_transformers) else None
    try:
        if engine is not None:  # warm up on every shape before timing
            astrai_decode(engine, 8, seed=99)
            if "prefill" in parts:
                astrai_prefill(engine, args.prefill_tokens, seed=98)
        if hf is not None:
            transformers_decode(hf, 8, seed=99)
        for r in range(args.repeats):
            if "decode" in parts:
                if engine is not None:
                    got = astrai_decode(engine, args.new_tokens, seed=r)
                    add("astrai_decode", got["tok_s"])
                    add("astrai_end_to_end", got["end_to_end_tok_s"])
                for label, extra in configs:
                    llama(f"llamacpp_decode_{label}", decode_args + extra)
                if hf is not None:
                    add("transformers_decode", transformers_decode(hf, args.new_tokens, seed=r))
            if "prefill" in parts:
                if engine is not None:
                    add("astrai_prefill", astrai_prefill(engine, args.prefill_tokens, seed=100 + r))
                for label, extra in configs:
                    llama(f"llamacpp_prefill_{label}", prefill_args + extra)
        if engine is not None:
            out["astrai_stats"] = engine.get_stats()
    finally:
        if engine is not None:
            engine.shutdown()
        del engine, hf
        gc.collect()
    out |= {key: summary(values) for key, values in samples.items()}
    out["errors"], out["decoded_without_context"] = errors, no_depth
    for kind in ("decode", "prefill"):
        ours = out.get(f"astrai_{kind}", {}).get("median")
        theirs = out.get(f"llamacpp_{kind}_default", {}).get("median")
        if ours and theirs:
            out[f"{kind}_ratio"] = ours / theirs
        plain = out.get(f"llamacpp_{kind}_repack0", {}).get("median")
        if ours and plain:
            out[f"{kind}_ratio_repack0"] = ours / plain
    for key in ("astrai_decode", "llamacpp_decode_default", "llamacpp_decode_repack0", "transformers_decode"):
        if out.get(key):
            out[key]["fraction_of_bound"] = out[key]["median"] / out["bound_tok_s"]
    if out.get("transformers_decode") and out.get("astrai_decode"):
        out["vs_transformers_ratio"] = out["astrai_decode"]["median"] / out["transformers_decode"]["median"]
    print_pair(out)
    return out


def run_depths(model: str, precision: str, llamacpp, args, bandwidth: float) -> list[dict]:
    """Decode after ``args.depths`` tokens already in the cache (``llama-bench -d``), both KV caches
    of ``args.kv_cache_dtype``'s width, rounds alternating the systems; one row per depth with the
    bound counting the KV bytes a step reads beside the weights'."""
    gguf = ensure_gguf(model, GGUF_TYPES[precision], llamacpp)
    bench = llamacpp.tool("llama-bench")
    cache_type = LLAMA_CACHE_TYPES[args.kv_cache_dtype]
    weight_bytes = weight_bytes_per_token(gguf)
    try:
        engine = open_astrai(ensure_hf(model), precision, max(args.depths) + args.new_tokens + 16,
                             kv_cache_dtype=args.kv_cache_dtype)
    except NotAvailable as exc:
        print(f"[{model} {precision}] astrai: not available ({exc})", flush=True)
        return []
    config = engine.model.config
    kv_bytes_per_token = (2 * config.n_layers * config.n_kv_heads * config.resolved_head_dim
                          * torch.empty(0, dtype=getattr(torch, args.kv_cache_dtype)).element_size())
    rows = []
    try:
        astrai_decode(engine, 8, seed=99, depth=64)  # warm-up
        for depth in args.depths:
            ours, theirs, errors = [], [], []
            # llama-bench warms up each of its runs; astrai's first decode at a new depth grows its decode buffers
            astrai_decode(engine, 4, seed=98, depth=depth)
            for r in range(args.repeats):
                ours.append(astrai_decode(engine, args.new_tokens, seed=r, depth=depth)["tok_s"])
                row = llama_bench(bench, gguf, args.threads, ["-p", "0", "-n", str(args.new_tokens), "-d", str(depth),
                                                              "-r", "1", "-ctk", cache_type, "-ctv", cache_type])
                rate = bench_rate(row)
                (theirs.append(rate) if rate is not None else errors.append(row["error"]))
            bound = bandwidth / (weight_bytes + kv_bytes_per_token * depth)
            out = {"model": model, "precision": precision, "gguf_type": GGUF_TYPES[precision], "depth": depth,
                   "kv_cache_dtype": args.kv_cache_dtype, "llamacpp_cache_type": cache_type,
                   "weight_bytes_per_token": weight_bytes, "kv_bytes_read": kv_bytes_per_token * depth,
                   "bound_tok_s": bound, "astrai_decode": summary(ours), "llamacpp_decode": summary(theirs),
                   "errors": errors}
            for key in ("astrai_decode", "llamacpp_decode"):
                if out[key]:
                    out[key]["fraction_of_bound"] = out[key]["median"] / bound
            if ours and theirs:
                out["ratio"] = statistics.median(ours) / statistics.median(theirs)
            rows.append(out)
            print(f"[{model} {precision}/{GGUF_TYPES[precision]} KV {args.kv_cache_dtype}/{cache_type}] depth {depth}: "
                  f"astrai {_fmt(out, 'astrai_decode')}, llama.cpp {_fmt(out, 'llamacpp_decode')} tok/s"
                  + (f", ratio {out['ratio']:.2f}x" if "ratio" in out else f" ({'; '.join(errors)})")
                  + f"; bound {bound:.1f} tok/s", flush=True)
        rows[-1]["astrai_stats"] = engine.get_stats()
    finally:
        engine.shutdown()
        del engine
        gc.collect()
    return rows


def _fmt(out: dict, key: str) -> str:
    value = out.get(key, {})
    return f"{value['median']:.1f}" if value else "-"


def print_pair(out: dict) -> None:
    head = f"[{out['model']} {out['precision']}/{out['gguf_type']}]"
    for kind in ("decode", "prefill"):
        keys = [k for k in (f"astrai_{kind}", f"llamacpp_{kind}_default", f"llamacpp_{kind}_repack0")
                if k in out or k in out["errors"]]
        if not keys:
            continue
        line = f"{head} {kind} tok/s: astrai {_fmt(out, f'astrai_{kind}')}, llama.cpp {_fmt(out, f'llamacpp_{kind}_default')}"
        if f"llamacpp_{kind}_repack0" in keys:
            line += f" (--repack 0: {_fmt(out, f'llamacpp_{kind}_repack0')})"
        if f"{kind}_ratio" in out:
            line += f", ratio {out[f'{kind}_ratio']:.2f}x"
        if kind == "decode":
            if "transformers_decode" in out:
                line += f"; transformers {_fmt(out, 'transformers_decode')}"
                if "vs_transformers_ratio" in out:
                    line += f", astrai/transformers {out['vs_transformers_ratio']:.2f}x"
            line += f"; bound {out['bound_tok_s']:.1f} tok/s"
            for key, name in (("astrai_decode", "astrai"), ("llamacpp_decode_default", "llama.cpp")):
                if out.get(key):
                    line += f", {name} {out[key]['fraction_of_bound']:.2f} of it"
        print(line, flush=True)


def astrai_serve_supports(flag: str) -> bool:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "astrai", "serve", "--help"], capture_output=True, text=True)
    return flag in done.stdout


def server_commands(model: str, precision: str, llamacpp, args, context: int, llama_extra: list[str],
                    astrai_extra: list[str]) -> tuple[dict[str, list[str] | None], str | None]:
    """llama-server's and astrai serve's command lines for one model and precision, ``args.server_slots``
    slots, ``context`` tokens of llama.cpp KV cache; astrai's is None (and the note says why) at a
    precision its serve verb lacks."""
    slots, threads = str(args.server_slots), str(args.threads)
    llama_cmd = [str(llamacpp.tool("llama-server")), "-m", str(ensure_gguf(model, GGUF_TYPES[precision], llamacpp)),
                 "-t", threads, "-tb", threads, "-np", slots, "-c", str(context), "--host", "127.0.0.1", "--no-webui",
                 "--alias", SERVED_NAME, *llama_extra]
    if precision in QUANTIZED:
        llama_cmd.append("--no-repack")  # repacked buffers can crash when prefilling on some CPUs (see README)
    astrai_cmd = [sys.executable, "-m", "astrai", "serve", "--model", str(ensure_hf(model)), "--host", "127.0.0.1",
                  "--max-batch-size", slots, "--served-model-name", SERVED_NAME, *astrai_extra]
    if precision in ASTRAI_DTYPES:
        return {"llamacpp": llama_cmd, "astrai": astrai_cmd + ["--dtype", str(ASTRAI_DTYPES[precision]).removeprefix("torch.")]}, None
    if astrai_serve_supports("--quantize"):
        return {"llamacpp": llama_cmd, "astrai": astrai_cmd + ["--quantize", precision]}, None
    return {"llamacpp": llama_cmd, "astrai": None}, f"not available: astrai serve has no --quantize {precision}"


def alternate_servers(label: str, commands: dict[str, list[str] | None], args, measure) -> dict[str, list[dict]]:
    """``measure(server)`` on each side's freshly started server, ``args.server_repeats`` rounds, the
    first side first in even rounds and last in odd ones; a failure is recorded as {"error": ...}."""
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {side: [] for side in commands}
    for r in range(args.server_repeats):
        for side in (list(commands) if r % 2 == 0 else list(reversed(commands))):
            if commands[side] is None:
                continue
            port = free_port()
            ready = "/health" if side == "llamacpp" else "/health/ready"
            try:
                with ServerProcess(commands[side] + ["--port", str(port)], port, ready, env=env,
                                   log=logs / f"{label.replace(' ', '-')}-{side}.log") as server:
                    result = measure(server)
            except (RuntimeError, OSError, httpx.HTTPError) as exc:
                result = {"error": f"{type(exc).__name__}: {exc}"}
            runs[side].append(result)
            if "error" in result:
                print(f"[{label}] {side}: {result['error']}", flush=True)
            else:
                print(f"[{label}] {side}: {result['output_tok_s']:.1f} output tok/s, TTFT p50 "
                      f"{result['ttft_p50_s']:.2f} s, p95 {result['ttft_p95_s']:.2f} s"
                      + (f", RSS {result['vm_rss_bytes'] / 1e9:.2f} GB (peak {result['vm_hwm_bytes'] / 1e9:.2f})"
                         if "vm_rss_bytes" in result else ""), flush=True)
    return runs


def median_runs(results: list[dict], keys: tuple[str, ...]):
    """Each of ``keys``' median over the runs that worked, beside all the runs (the runs alone when none did)."""
    good = [r for r in results if "error" not in r]
    return results if not good else {**{k: statistics.median(r[k] for r in good) for k in keys}, "runs": results}


def warmup_requests() -> list[tuple[list[int], int]]:
    return mixed_requests(2, PROMPT_VOCAB, (16, 32), (4, 4), seed=8)


def run_server(model: str, precision: str, llamacpp, args) -> dict:
    """The load test against llama-server and astrai serve, alternated ``server_repeats`` times."""
    requests = mixed_requests(args.server_requests, PROMPT_VOCAB, (16, 256), (32, 128), seed=7)
    commands, astrai_note = server_commands(model, precision, llamacpp, args, args.server_slots * (256 + 128 + 64),
                                            [], ["--max-seq-len", "512"])
    out = {"model": model, "precision": precision, "gguf_type": GGUF_TYPES[precision], "slots": args.server_slots,
           "requests": len(requests), "output_tokens": sum(n for _, n in requests),
           "llama_server_command": commands["llamacpp"][1:],
           "astrai_serve_command": commands["astrai"] and commands["astrai"][1:]}

    def measure(server: ServerProcess) -> dict:
        run_load(server.base_url, SERVED_NAME, warmup_requests())
        return run_load(server.base_url, SERVED_NAME, requests)

    runs = alternate_servers(f"server {model} {precision}", commands, args, measure)
    for side, results in runs.items():
        out[side] = median_runs(results, ("output_tok_s", "ttft_p50_s", "ttft_p95_s"))
    if astrai_note:
        out["astrai"] = astrai_note
    if isinstance(out.get("astrai"), dict) and isinstance(out.get("llamacpp"), dict):
        out["ratio"] = out["astrai"]["output_tok_s"] / out["llamacpp"]["output_tok_s"]
        print(f"[server {model} {precision}] astrai / llama-server: {out['ratio']:.2f}x output tok/s", flush=True)
    return out


def run_chat(model: str, precision: str, llamacpp, args) -> dict:
    """The chat workload (bench/chat_workload.py) against astrai serve and llama-server with equal KV
    capacity (``server_slots`` x ``chat_slot_tokens`` tokens) and KV precision, alternated
    ``server_repeats`` times; the servers' resident memory is read after each run."""
    model_dir = ensure_hf(model)
    conversations = build_conversations(AutoTokenizer.from_pretrained(model_dir), args.chat_users, args.chat_turns,
                                        args.chat_slot_tokens, CHAT_NEW_TOKENS, seed=CHAT_SEED)
    capacity = args.server_slots * args.chat_slot_tokens
    kv_dtype = args.chat_kv_cache_dtype
    cache_type = LLAMA_CACHE_TYPES[kv_dtype]
    commands, astrai_note = server_commands(
        model, precision, llamacpp, args, capacity, ["-ctk", cache_type, "-ctv", cache_type],
        ["--max-seq-len", str(args.chat_slot_tokens), "--page-size", str(CHAT_PAGE_SIZE),
         "--num-pages", str(capacity // CHAT_PAGE_SIZE), "--kv-cache-dtype", kv_dtype])
    out = {"model": model, "precision": precision, "gguf_type": GGUF_TYPES[precision], "users": args.chat_users,
           "turns": args.chat_turns, "new_tokens": CHAT_NEW_TOKENS, "slots": args.server_slots,
           "slot_tokens": args.chat_slot_tokens, "kv_capacity_tokens": capacity, "kv_cache_dtype": kv_dtype,
           "llamacpp_cache_type": cache_type, "seed": CHAT_SEED,
           "prompt_tokens_by_turn": [[len(prompts[k]) for prompts in conversations] for k in range(args.chat_turns)],
           "llama_server_command": commands["llamacpp"][1:],
           "astrai_serve_command": commands["astrai"] and commands["astrai"][1:]}

    def measure(server: ServerProcess) -> dict:
        run_load(server.base_url, SERVED_NAME, warmup_requests())
        return run_conversations(server.base_url, SERVED_NAME, conversations, CHAT_NEW_TOKENS) | resident_memory(server.process.pid)

    label = f"chat {model} {precision}"
    runs = alternate_servers(label, {"astrai": commands["astrai"], "llamacpp": commands["llamacpp"]}, args, measure)
    for side, results in runs.items():
        out[side] = median_runs(results, CHAT_FIGURES)
    if astrai_note:
        out["astrai"] = astrai_note
    if isinstance(out.get("astrai"), dict) and isinstance(out.get("llamacpp"), dict):
        for key, name in zip(CHAT_FIGURES, ("ratio", "ttft_p50_ratio", "ttft_p95_ratio", "rss_ratio", "peak_rss_ratio")):
            out[name] = out["astrai"][key] / out["llamacpp"][key]
        print(f"[{label}] astrai / llama-server: {out['ratio']:.2f}x output tok/s, TTFT p95 {out['ttft_p95_ratio']:.2f}x, "
              f"RSS {out['rss_ratio']:.2f}x", flush=True)
    return out


def print_table(pairs: list[dict], servers: list[dict], chats: list[dict]) -> None:
    """The ratios of the whole benchmark run (astrai / llama.cpp, medians), one line per pair."""
    def ratio(row: dict, key: str) -> str:
        return f"{row[key]:.2f}x" if key in row else "-"

    def fraction(row: dict, key: str) -> str:
        return f"{row[key]['fraction_of_bound']:.2f}" if row.get(key) else "-"

    def failed(side) -> str:  # a side's note, its runs' errors (none worked), or "ran" (the other side failed)
        return side if isinstance(side, str) else "; ".join(r["error"] for r in side) if isinstance(side, list) else "ran"

    def both(row: dict, key: str, scale: float = 1.0, digits: int = 2) -> str:
        return f"{row['astrai'][key] / scale:.{digits}f}/{row['llamacpp'][key] / scale:.{digits}f}"

    print()
    if pairs:
        print(f"{'model':<8} {'precision':<9} {'decode':>7} {'repack 0':>8} {'prefill':>7} {'repack 0':>8} "
              f"{'of bound: astrai':>16} {'llama.cpp':>9}")
    for p in pairs:
        print(f"{p['model']:<8} {p['precision']:<9} {ratio(p, 'decode_ratio'):>7} {ratio(p, 'decode_ratio_repack0'):>8} "
              f"{ratio(p, 'prefill_ratio'):>7} {ratio(p, 'prefill_ratio_repack0'):>8} "
              f"{fraction(p, 'astrai_decode'):>16} {fraction(p, 'llamacpp_decode_default'):>9}"
              + (f"  astrai {p['astrai']}" if "astrai" in p else ""))
    for p in pairs:
        if "vs_transformers_ratio" in p:
            print(f"{p['model']} {p['precision']} decode, astrai / transformers: {p['vs_transformers_ratio']:.2f}x")
    for s in servers:
        print(f"server {s['model']} {s['precision']}, astrai / llama-server output tok/s: {ratio(s, 'ratio')}")
    if chats:
        first = chats[0]
        print(("\n" if pairs or servers else "") + f"chat on {first['model']}: {first['users']} users x {first['turns']} turns, KV cache "
              f"{first['kv_capacity_tokens']} tokens {first['kv_cache_dtype']} on both; astrai/llama-server")
        print(f"{'precision':<9} {'output tok/s':>13} {'ratio':>6} {'TTFT p50 s':>11} {'TTFT p95 s':>11} "
              f"{'RSS GB':>11} {'peak RSS GB':>11} {'RSS ratio':>9}")
    for c in chats:
        if "ratio" not in c:
            print(f"{c['precision']:<9} astrai: {failed(c['astrai'])}; llama-server: {failed(c['llamacpp'])}")
            continue
        print(f"{c['precision']:<9} {both(c, 'output_tok_s', digits=1):>13} {ratio(c, 'ratio'):>6} "
              f"{both(c, 'ttft_p50_s'):>11} {both(c, 'ttft_p95_s'):>11} {both(c, 'vm_rss_bytes', 1e9):>11} "
              f"{both(c, 'vm_hwm_bytes', 1e9):>11} {ratio(c, 'rss_ratio'):>9}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default=",".join(GGUF_TYPES))
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"of {','.join(PARTS)}")
    parser.add_argument("--repeats", type=int, default=None,
                        help="alternating rounds per pair (default 3 on SmolLM2, 1 on the 1B model; --quick: 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=None, help="decode length (default 128; --quick 32)")
    parser.add_argument("--prefill-tokens", type=int, default=None, help="prefill length (default 512; --quick 128)")
    parser.add_argument("--server-precisions", default="fp32",
                        help="precisions of the server and chat parts (SmolLM2 only)")
    parser.add_argument("--depths", default=None,
                        help="context lengths already cached before the depth part's decode (llama-bench -d); "
                             "given alone, it runs the depth part only (default 512,2048,4096,8000)")
    parser.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=LLAMA_CACHE_TYPES, default=None,
                        help="both systems' KV cache in the depth and chat parts, llama.cpp's -ctk/-ctv of the same "
                             "width (default: float32 in depth; float16, llama.cpp's default, in chat)")
    parser.add_argument("--server-requests", type=int, default=None, help="default 64 (--quick 16)")
    parser.add_argument("--server-slots", type=int, default=16, help="llama-server -np and astrai --max-batch-size")
    parser.add_argument("--server-repeats", type=int, default=1,
                        help="rounds of the server and chat parts (each round starts both servers afresh; "
                             "odd rounds start with the other one)")
    parser.add_argument("--chat-users", type=int, default=None, help="conversations at once (default 16; --quick 4)")
    parser.add_argument("--chat-turns", type=int, default=None, help="turns per conversation (default 6; --quick 3)")
    parser.add_argument("--chat-slot-tokens", type=int, default=4096,
                        help="context per slot (llama-server -c is --server-slots times it); a conversation's last "
                             "turn holds half to all of it less the 64-token reply")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' decode on SmolLM2 fp32")
    parser.add_argument("--quick", action="store_true", help="one round, shorter runs (a smoke run, not a result)")
    parser.add_argument("--log-dir", default=str(Path.home() / ".cache" / "astrai" / "bench-logs"),
                        help="where the servers' logs go")
    parser.add_argument("--llamacpp-bin", default=None, metavar="DIR",
                        help="bin directory of a llama.cpp build (default: bench/build_llamacpp.sh's, built if needed)")
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()
    if args.depths and "--parts" not in sys.argv:
        args.parts = "depth"
    args.depths = [int(d) for d in (args.depths or "512,2048,4096,8000").split(",")]
    for name, given, known in (("--models", args.models, MODELS), ("--precisions", args.precisions, GGUF_TYPES),
                               ("--parts", args.parts, PARTS), ("--server-precisions", args.server_precisions, GGUF_TYPES)):
        unknown = [v for v in given.split(",") if v not in known]
        if unknown:
            parser.error(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    args.models, args.precisions = args.models.split(","), args.precisions.split(",")
    args.parts, args.server_precisions = set(args.parts.split(",")), args.server_precisions.split(",")
    args.new_tokens = args.new_tokens or (32 if args.quick else 128)
    args.prefill_tokens = args.prefill_tokens or (128 if args.quick else 512)
    args.server_requests = args.server_requests or (16 if args.quick else 64)
    args.chat_users = args.chat_users or (4 if args.quick else 16)
    args.chat_turns = args.chat_turns or (3 if args.quick else 6)
    args.chat_kv_cache_dtype = args.kv_cache_dtype or "float16"
    args.kv_cache_dtype = args.kv_cache_dtype or "float32"
    if args.quick:
        args.repeats = args.repeats or 1
    for name in ("repeats", "threads", "new_tokens", "prefill_tokens", "server_requests", "server_slots", "server_repeats",
                 "chat_users", "chat_turns"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.chat_slot_tokens % CHAT_PAGE_SIZE or args.chat_slot_tokens < 4 * CHAT_NEW_TOKENS:
        parser.error(f"--chat-slot-tokens must be a multiple of {CHAT_PAGE_SIZE} (astrai's page) and at least "
                     f"{4 * CHAT_NEW_TOKENS}, got {args.chat_slot_tokens}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    tune_process()  # as the CLI verbs do
    llamacpp = locate_llamacpp(Path(args.llamacpp_bin)) if args.llamacpp_bin else build_llamacpp()
    for model in args.models:  # make everything first, so no conversion lands inside the measured run
        ensure_hf(model)
        single = set(args.precisions) if args.parts & {"decode", "prefill", "depth"} else set()
        for precision in single | (set(args.server_precisions) if args.parts & {"server", "chat"} else set()):
            ensure_gguf(model, GGUF_TYPES[precision], llamacpp)
    started = time.perf_counter()
    bandwidths = [read_bandwidth(args.threads)]
    print(f"streaming-read bandwidth ({args.threads} threads): {bandwidths[0] / 1e9:.1f} GB/s", flush=True)
    pairs, servers, depths, chats = [], [], [], []
    interrupted = False
    try:
        for model in args.models:
            saved_repeats = args.repeats
            if args.repeats is None:
                args.repeats = 3 if model == "smollm2" else 1
            for precision in args.precisions:
                if args.parts & {"decode", "prefill"}:
                    pairs.append(run_pair(model, precision, llamacpp, args, bandwidths[0]))
                if "depth" in args.parts:
                    depths += run_depths(model, precision, llamacpp, args, bandwidths[0])
            args.repeats = saved_repeats
            if "server" in args.parts and model == "smollm2":
                servers += [run_server(model, precision, llamacpp, args) for precision in args.server_precisions]
            if "chat" in args.parts and model == "smollm2":
                chats += [run_chat(model, precision, llamacpp, args) for precision in args.server_precisions]
        bandwidths.append(read_bandwidth(args.threads))
        print(f"streaming-read bandwidth after the run: {bandwidths[1] / 1e9:.1f} GB/s", flush=True)
    except KeyboardInterrupt:  # a grid runs for hours: Ctrl-C keeps the cells already measured
        interrupted = True
        print("interrupted: writing the cells measured so far", flush=True)
    print_table(pairs, servers, chats)
    results = {"threads": args.threads, "quick": args.quick, "interrupted": interrupted, "new_tokens": args.new_tokens,
               "prompt_tokens": PROMPT_TOKENS, "prefill_tokens": args.prefill_tokens,
               "read_bandwidth_gb_s": [b / 1e9 for b in bandwidths],
               "bound_note": "bound_tok_s = streaming-read bandwidth before the run / weight_bytes_per_token",
               "seconds": time.perf_counter() - started, "pairs": pairs, "server": servers, "depths": depths,
               "chat": chats}
    write_result("vs_llamacpp-quick" if args.quick else "vs_llamacpp", results, args.out)


if __name__ == "__main__":
    main()
