"""Benchmark: astrai's inference engine on a GPU against transformers' ``generate``, same weights.

The astrai model (random weights in a preset's shape, bf16) is exported with ``export_hf``
and reopened with ``AutoModelForCausalLM`` (Llama, or Qwen3 for a preset with QK-norm), so both sides hold identical weights on the same GPU.
Measured, each side warmed up first and the two alternated:

1. ``single``: one request's greedy decode (16-token prompt, 256 new tokens), tokens/s, and as
   a fraction of the bandwidth bound: every weight byte is read once per token, so no decode
   runs faster than (the GPU's device-to-device copy rate) / (the weights' bytes);
2. ``throughput``: 64 requests with mixed prompt (16-512) and output (16-256) lengths, output
   tokens/s of the continuous-batching engine against ``generate`` on left-padded static
   batches of 16.

Usage: python bench/gpu_generate.py [--preset 1b] [--parts single,throughput] [--device cuda]
Writes a dated JSON file to bench/results/ (see results_file.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.config import preset  # noqa: E402
from astrai.inference import InferenceEngine, SamplingParams  # noqa: E402
from astrai.model import AutoModel  # noqa: E402
from astrai.model.hf import export_hf  # noqa: E402
from generate import hf_generate  # noqa: E402  (bench/generate.py: the same generate call on the CPU)
from results_file import write_result  # noqa: E402


def build_pair(cfg, device: torch.device, dtype: torch.dtype):
    """The astrai model and the transformers Llama holding the same weights, on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return model.to(device, dtype), hf


def copy_bandwidth(device: torch.device, gib: int = 4, repeats: int = 10) -> float:
    """Bytes read plus bytes written per second by the best of ``repeats`` device-to-device copies."""
    a = torch.empty(gib * 2 ** 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() / best


def engine_generate(engine, prompts: list[list[int]], counts: list[int]) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    handles = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
               for p, n in zip(prompts, counts)]
    outputs = [h.result(timeout=600).token_ids for h in handles]
    return outputs, time.perf_counter() - start


def single(model, hf, cfg, device, n_new: int, repeats: int) -> dict:
    prompt = [random.Random(0).randrange(cfg.vocab_size) for _ in range(16)]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device)
    bound = bandwidth / weight_bytes
    with InferenceEngine(model, None, max_batch_size=1, page_size=16, max_seq_len=1024) as engine:
        engine_generate(engine, [prompt], [16])
        hf_generate(hf, [prompt], 16)
        ours, theirs = float("inf"), float("inf")
        for _ in range(repeats):
            engine.scheduler.clear_prefix_cache()
            ours_ids, t = engine_generate(engine, [prompt], [n_new])
            ours = min(ours, t)
            theirs_ids, t = hf_generate(hf, [prompt], n_new)
            theirs = min(theirs, t)
        paths = engine.get_stats()["decode_paths"]
    row = {"preset": cfg_name(cfg), "weight_bytes": weight_bytes, "copy_bandwidth_bytes_s": bandwidth,
           "bound_tok_s": bound, "new_tokens": n_new, "astrai_tok_s": n_new / ours, "transformers_tok_s": n_new / theirs,
           "ratio": theirs / ours, "astrai_fraction_of_bound": n_new / ours / bound,
           "transformers_fraction_of_bound": n_new / theirs / bound,
           "same_tokens": ours_ids[0] == theirs_ids[0], "decode_paths": paths}
    print(f"[single] astrai {row['astrai_tok_s']:.1f} tok/s, transformers {row['transformers_tok_s']:.1f} tok/s, "
          f"ratio {row['ratio']:.2f}x; bound {bound:.0f} tok/s ({weight_bytes / 1e9:.2f} GB at "
          f"{bandwidth / 1e12:.2f} TB/s): astrai {row['astrai_fraction_of_bound']:.1%}, transformers "
          f"{row['transformers_fraction_of_bound']:.1%}; identical greedy tokens: {row['same_tokens']}", flush=True)
    return row


def throughput(model, hf, cfg, n_requests: int, rounds: int) -> dict:
    rng = random.Random(1)
    lens = [(rng.randint(16, 512), rng.randint(16, 256)) for _ in range(n_requests)]
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(p)] for p, _ in lens]
    outs = [o for _, o in lens]
    useful = sum(outs)
    hf_generate(hf, prompts[:16], 4)
    hf_times, our_times = [], []
    with InferenceEngine(model, None, max_batch_size=n_requests, page_size=16, max_seq_len=1024,
                         num_pages=n_requests * 48 + 64) as engine:
        engine_generate(engine, prompts[:16], [4] * 16)
        for _ in range(rounds):
            hf_times.append(sum(hf_generate(hf, prompts[i:i + 16], max(outs[i:i + 16]))[1]
                                for i in range(0, n_requests, 16)))
            engine.scheduler.clear_prefix_cache()
            our_times.append(engine_generate(engine, prompts, outs)[1])
        stats = engine.get_stats()
    row = {"requests": n_requests, "output_tokens": useful, "astrai_tok_s": useful / min(our_times),
           "transformers_tok_s": useful / min(hf_times), "ratio": min(hf_times) / min(our_times),
           "preemptions": stats["preemptions"], "astrai_seconds": our_times, "transformers_seconds": hf_times}
    print(f"[throughput] {n_requests} mixed requests: astrai {row['astrai_tok_s']:.0f} tok/s, transformers static "
          f"batches of 16 {row['transformers_tok_s']:.0f} tok/s, ratio {row['ratio']:.2f}x", flush=True)
    return row


def cfg_name(cfg) -> str:
    return f"dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--parts", default="single,throughput")
    parser.add_argument("--device", default="cuda", type=torch.device)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()
    if args.device.type != "cuda" or not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this benchmark needs a visible CUDA GPU (bench/generate.py is the CPU's)")
    cfg = preset(args.preset)
    model, hf = build_pair(cfg, args.device, torch.bfloat16)
    parts = args.parts.split(",")
    import transformers

    out = {"preset": args.preset, "dtype": "bfloat16", "device": torch.cuda.get_device_name(args.device),
           "transformers": transformers.__version__}
    path = args.out
    # written after each part, so a run stopped partway keeps what it measured
    if "single" in parts:
        out["single"] = single(model, hf, cfg, args.device, args.new_tokens, args.repeats)
        path = write_result("gpu_generate", out, path)
    if "throughput" in parts:
        out["throughput"] = throughput(model, hf, cfg, args.requests, args.rounds)
        path = write_result("gpu_generate", out, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
