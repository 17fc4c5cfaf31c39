"""Benchmark: single-stream decode after a long context is already in the cache (astrai only).

A chat past a system prompt and a few turns decodes with thousands of tokens in the cache,
and each step then reads every cached K/V vector once besides the weights: at 4,096
tokens of SmolLM2-135M that is 94 MiB in fp32, more than its int8 weights. For each
precision, KV cache dtype, decode path and depth, the engine prefills ``depth`` prompt
tokens (not timed) and decodes ``--new-tokens`` greedy tokens; the rate counts the steps
after the first token. Beside it:

- ``attention_ms``: the decode attention kernel alone over every layer's buffers of that
  depth (the weights' share of a step is the rest);
- ``bound_tok_s``: (weight bytes + KV bytes read per step) / streaming-read bandwidth,
  and the rate as a fraction of it.

Paths: ``fused`` (the one-call C step, ``decode_paths["fused"]``) and ``forward`` (the model's
own forward with the C row kernels, as a batch of one takes it with ``ASTRAI_FUSED_DECODE=0``).
The model is bench/llamacpp_models.py's SmolLM2-135M directory.

Usage: OMP_NUM_THREADS=2 .venv/bin/python bench/long_context.py [--depths 512,2048,4096,8000]
       [--precisions fp32,int8] [--kv-cache-dtypes float32,bfloat16] [--paths fused,forward]
Writes a dated JSON file to bench/results/ (see results_file.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.backends.cpu import tune_process  # noqa: E402
from astrai.backends.cpu.kernels import decode_attention, kernels_available  # noqa: E402
from astrai.inference import InferenceEngine  # noqa: E402
from astrai.inference.engine import load_model  # noqa: E402
from astrai.model.quantized import QuantizedLinear  # noqa: E402
from llamacpp_models import ensure_hf  # noqa: E402  (bench/ is on sys.path when a script runs)
from results_file import write_result  # noqa: E402
from vs_llamacpp import ASTRAI_DTYPES, astrai_decode, read_bandwidth  # noqa: E402

PATHS = ("fused", "forward")
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_bytes(model_dir: Path, precision: str) -> int:
    """Bytes of the linear weights (and their scales) one decode step streams, the head included."""
    dtype = ASTRAI_DTYPES.get(precision)
    model = load_model(model_dir, dtype, "cpu", None if dtype is not None else precision)
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.qweight.numel() * module.qweight.element_size() + module.scales.numel() * 2
        elif isinstance(module, torch.nn.Linear) or type(module).__name__ == "Linear":
            total += module.weight.numel() * module.weight.element_size()
    return total


def attention_ms(config, depth: int, kv_dtype: torch.dtype, repeats: int = 5) -> float | None:
    """One step's decode attention over every layer at ``depth`` through the C kernel, in ms."""
    if not kernels_available():
        return None
    heads, kv_heads, width = config.n_heads, config.n_kv_heads, config.resolved_head_dim
    layers = [(torch.randn(1, kv_heads, depth + 64, width).to(kv_dtype),
               torch.randn(1, kv_heads, depth + 64, width).to(kv_dtype)) for _ in range(config.n_layers)]
    q = torch.randn(1, 1, heads, width)
    lens = torch.tensor([depth])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for k, v in layers:
            decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), lens, width ** -0.5)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def open_engine(model_dir: Path, precision: str, kv_dtype: str, path: str, max_seq_len: int) -> InferenceEngine:
    dtype = ASTRAI_DTYPES.get(precision)
    previous = os.environ.get("ASTRAI_FUSED_DECODE")
    os.environ["ASTRAI_FUSED_DECODE"] = "1" if path == "fused" else "0"  # read once, when the runner is made
    try:
        return InferenceEngine.from_pretrained(model_dir, dtype=dtype, quantize=None if dtype else precision,
                                               max_batch_size=1, max_seq_len=max_seq_len, kv_cache_dtype=kv_dtype)
    finally:
        if previous is None:
            os.environ.pop("ASTRAI_FUSED_DECODE")
        else:
            os.environ["ASTRAI_FUSED_DECODE"] = previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", default="512,2048,4096,8000")
    parser.add_argument("--precisions", default="fp32,int8")
    parser.add_argument("--kv-cache-dtypes", default="float32")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    kv_dtypes, paths = args.kv_cache_dtypes.split(","), args.paths.split(",")
    for name, given, known in (("--kv-cache-dtypes", kv_dtypes, KV_DTYPES), ("--paths", paths, PATHS)):
        if any(value not in known for value in given):
            parser.error(f"{name}: choose from {', '.join(known)}")
    torch.set_num_threads(args.threads)
    tune_process()
    model_dir = ensure_hf("smollm2")
    bandwidth = read_bandwidth(args.threads)
    print(f"streaming-read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = []
    for precision in args.precisions.split(","):
        weights = weight_bytes(model_dir, precision)
        for kv_dtype in kv_dtypes:
            for path in paths:
                engine = open_engine(model_dir, precision, kv_dtype, path, max(depths) + args.new_tokens + 16)
                config = engine.model.config
                kv_per_token = 2 * config.n_layers * config.n_kv_heads * config.resolved_head_dim \
                    * KV_DTYPES[kv_dtype].itemsize
                try:
                    astrai_decode(engine, 8, seed=99, depth=64)  # warm-up
                    for depth in sorted(depths):  # one prompt growing: each depth prefills only its new tokens
                        rates = [astrai_decode(engine, args.new_tokens, seed=0, depth=depth, fresh=False)["tok_s"]
                                 for _ in range(args.repeats)]
                        rate = max(rates)
                        bound = bandwidth / (weights + kv_per_token * depth)
                        row = {"precision": precision, "kv_cache_dtype": kv_dtype, "path": path, "depth": depth,
                               "tok_s": rate, "samples": rates, "step_ms": 1e3 / rate,
                               "attention_ms": attention_ms(config, depth, KV_DTYPES[kv_dtype]),
                               "weight_bytes": weights, "kv_bytes": kv_per_token * depth,
                               "bound_tok_s": bound, "fraction_of_bound": rate / bound}
                        rows.append(row)
                        attn = row["attention_ms"]
                        print(f"{precision:5} kv {kv_dtype:8} {path:7} depth {depth:5}: {rate:6.1f} tok/s "
                              f"(step {row['step_ms']:.2f} ms, attention kernel {attn or float('nan'):.2f} ms; "
                              f"bound {bound:.1f} tok/s, {rate / bound:.0%} of it)", flush=True)
                    rows[-1]["decode_paths"] = engine.get_stats().get("decode_paths")
                finally:
                    engine.shutdown()
                    del engine
                    gc.collect()
    write_result("long_context", {"threads": args.threads, "new_tokens": args.new_tokens,
                                  "read_bandwidth_gb_s": bandwidth / 1e9,
                                  "bound_note": "bound_tok_s = bandwidth / (weight bytes + KV bytes read per step)",
                                  "rows": rows}, args.out)


if __name__ == "__main__":
    main()
