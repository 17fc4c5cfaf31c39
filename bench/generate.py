"""Benchmark: astrai's inference engine against transformers' ``generate`` on the same weights.

Each astrai model is exported with ``astrai.model.hf.export_llama`` and reopened as
``LlamaForCausalLM``, so both sides run identical weights in the same process. Both
are warmed up on every shape first. Measured, in one run:

1. single-request greedy decode tokens/s on the tiny and small presets (target >= 1.5x);
2. the same on a ~125M model, reported as a fraction of the memory-bandwidth bound
   (weight bytes read per token / measured copy bandwidth; target >= 0.9), each run
   against the bandwidth measured around it (see ``bandwidth_bound``): end to end (the
   16-token prompt's prefill included, the headline) and for the decode steps alone;
3. 64 requests with mixed prompt (16-512) and output (16-256) lengths: output tokens/s
   of the continuous-batching engine vs ``generate`` on padded static batches of 16
   (target >= 3x; best of 3 alternating runs per side);
4. time to first token of 16 requests sharing a 1,000-token system prompt, prefix
   cache on vs off (target >= 5x).

Usage: OMP_NUM_THREADS=2 .venv/bin/python bench/generate.py [--parts single,bound,throughput,ttft] [--quick]
       [--bound-rounds N] [--bound-repeats N]
Writes a dated JSON file to bench/results/ (see results_file.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.config import preset  # noqa: E402
from astrai.backends.cpu import tune_process  # noqa: E402
from astrai.backends.cpu.huge_pages import huge_page_empty  # noqa: E402
from astrai.inference import InferenceEngine, SamplingParams  # noqa: E402
from astrai.model import AutoModel  # noqa: E402
from astrai.model.hf import export_llama  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

MODEL_125M = dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, dim_ffn=2816, max_len=2048)


def build_pair(cfg):
    """The astrai model and the transformers Llama holding the same weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        export_llama(model, tmp)
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return model, hf


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, streamer=None) -> tuple[list[list[int]], float]:
    """Greedy ``generate`` on a left-padded batch, on the model's device; returns the new tokens
    and seconds taken (reading the tokens back waits for a GPU's queued work)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, streamer=streamer)
    return out[:, width:].tolist(), time.perf_counter() - start


class FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives (its first ``put``
    is the prompt), so a run's decode time can be told from its prefill."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def engine_generate(engine, prompts: list[list[int]], new_tokens) -> tuple[list, float, list[float]]:
    """Submit all prompts at once; returns outputs, seconds, and each request's time to first token
    (taken by the scheduler when the token is sampled: reading the handles one after another
    would otherwise add the earlier requests' whole generation to the later ones' wait)."""
    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    start = time.perf_counter()
    handles = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
               for p, n in zip(prompts, counts)]
    outputs = [[t for ev in h for t in ev.token_ids] for h in handles]
    return outputs, time.perf_counter() - start, [h.time_to_first_token for h in handles]


def single_request(name, cfg, n_new, repeats=5) -> dict:
    """Alternate astrai and transformers runs and keep each side's best, so a burst of
    load from other processes does not land on one side only."""
    model, hf = build_pair(cfg)
    prompt = [random.Random(0).randrange(cfg.vocab_size) for _ in range(16)]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=1, num_pages=64, page_size=16) as engine:
        engine_generate(engine, [prompt], 8)
        hf_generate(hf, [prompt], 8)
        ours, theirs = float("inf"), float("inf")
        for _ in range(repeats):
            engine.scheduler.clear_prefix_cache()  # transformers keeps nothing between calls either
            start = time.perf_counter()
            ours_ids = engine.submit(prompt, params).result().token_ids
            ours = min(ours, time.perf_counter() - start)
            theirs_ids, t = hf_generate(hf, [prompt], n_new)
            theirs = min(theirs, t)
        streamed = min(engine_generate(engine, [prompt], n_new)[1] for _ in range(2))
    row = {"model": name, "params": model.num_parameters(), "new_tokens": n_new,
           "astrai_tok_s": n_new / ours, "astrai_streamed_tok_s": n_new / streamed,
           "transformers_tok_s": n_new / theirs, "ratio": theirs / ours, "same_tokens": ours_ids == theirs_ids[0]}
    print(f"[single] {name}: astrai {row['astrai_tok_s']:.1f} tok/s (streamed {row['astrai_streamed_tok_s']:.1f}), "
          f"transformers {row['transformers_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}x, "
          f"identical greedy tokens: {row['same_tokens']}", flush=True)
    return row


class CopyBandwidth:
    """(copy, read) bandwidth in bytes/s: a large tensor copy counted as read + write (as
    STREAM does), and a large sum, which only reads - the access pattern of a GEMV.
    1 GiB buffers, so the working set exceeds even a very large last-level cache; a model
    whose weights fit in that cache can decode faster than this DRAM bound. Measured on
    plain memory and on memory advised for 2 MiB pages (which the engine lays its weights
    in) and the better taken, so the bound is the machine's best, not a handicapped copy.
    The buffers are made once, so measuring between decode runs costs only the copies."""

    def __init__(self, nbytes=1024**3):
        self.nbytes = nbytes
        self.pairs = []
        for empty in (lambda n: torch.empty(n), lambda n: huge_page_empty((n,))):
            src = empty(nbytes // 4).fill_(1.0)
            self.pairs.append((src, empty(nbytes // 4)))

    def measure(self, repeats=5) -> tuple[float, float]:
        best_copy = best_read = 0.0
        for src, dst in self.pairs:
            dst.copy_(src)
            copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
            read = min(_timed(lambda: src.sum()) for _ in range(repeats))
            best_copy, best_read = max(best_copy, 2 * self.nbytes / copy), max(best_read, self.nbytes / read)
        return best_copy, best_read


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bandwidth_bound(n_new, rounds=8, repeats=3) -> dict:
    """Decode tokens/s of the ~125M model against the copy bound, in rounds that each time
    ``repeats`` astrai and transformers decodes, with the copy bandwidth measured before each
    pair of runs and after the last.

    A shared virtual machine can switch between bandwidth levels (say 45 and 75 GB/s) for
    spells of seconds to minutes, and a bound measured at one level set against a decode run
    at the other says little about the code. So each round's fraction is taken
    against the bandwidth measured around it, only rounds whose measurements agree within 10%
    count (the level held through the round), and the median of those is reported.

    The copy bandwidth is the best of its copies (``CopyBandwidth.measure``), so each side's
    decode is the best of its ``repeats`` runs too, as in ``single_request``; at the faster
    level the bandwidth also wavers within a round, which a single run takes the brunt of.
    The first run's fraction is kept beside it (``*_first_fraction``)."""
    cfg = preset("small", **MODEL_125M)
    model, hf = build_pair(cfg)
    weight_bytes = model.num_parameters() * 4  # tied embedding: lm_head reads it once, the lookup reads one row
    prompt = [random.Random(0).randrange(cfg.vocab_size) for _ in range(16)]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    meter = CopyBandwidth()
    runs = []

    def ours() -> tuple[float, float, list[int]]:
        """(seconds, seconds to the first token, tokens) of one astrai decode."""
        engine.scheduler.clear_prefix_cache()  # transformers keeps nothing between calls either
        start = time.perf_counter()
        handle = engine.submit(prompt, params)
        ids = handle.result().token_ids
        return time.perf_counter() - start, handle.time_to_first_token, ids

    def theirs() -> tuple[float, float, list[int]]:
        clock = FirstTokenClock()
        start = time.perf_counter()
        ids, seconds = hf_generate(hf, [prompt], n_new, streamer=clock)
        return seconds, clock.first - start, ids[0]

    with InferenceEngine(model, None, max_batch_size=1, num_pages=64, page_size=16) as engine:
        engine_generate(engine, [prompt], 8)
        hf_generate(hf, [prompt], 8)
        for _ in range(rounds):
            timed, measured = {"astrai": [], "transformers": []}, []
            for _ in range(repeats):  # the bandwidth before each pair of runs and after the last
                measured.append(meter.measure())
                timed["astrai"].append(ours())
                timed["transformers"].append(theirs())
            measured.append(meter.measure())
            copies = [m[0] for m in measured]
            copy = statistics.mean(copies)
            row = {"copy_gb_s": copy / 1e9, "read_gb_s": statistics.mean(m[1] for m in measured) / 1e9,
                   "steady": min(copies) >= 0.9 * max(copies)}
            for side, results in timed.items():
                seconds, first, ids = min(results, key=lambda r: r[0])
                # decode alone: the tokens after the first over the time after it (the prefill,
                # compute-bound, reads the weights once for all the prompt's tokens)
                decode = (n_new - 1) / (seconds - first)
                row |= {f"{side}_tok_s": n_new / seconds, f"{side}_fraction": n_new / seconds * weight_bytes / copy,
                        f"{side}_first_fraction": n_new / results[0][0] * weight_bytes / copy,
                        f"{side}_decode_tok_s": decode, f"{side}_decode_fraction": decode * weight_bytes / copy,
                        f"{side}_tokens": ids}
            row["ratio"] = row["astrai_tok_s"] / row["transformers_tok_s"]
            row["same_tokens"] = row.pop("astrai_tokens") == row.pop("transformers_tokens")
            runs.append(row)
    counted = [r for r in runs if r["steady"]] or runs
    median = lambda key, rows=counted: statistics.median(r[key] for r in rows)  # noqa: E731
    levels = [{"copy_gb_s": median("copy_gb_s", level), "rounds": len(level),
               "astrai_fraction_of_bound": median("astrai_fraction", level),
               "astrai_first_fraction_of_bound": median("astrai_first_fraction", level),
               "astrai_decode_fraction_of_bound": median("astrai_decode_fraction", level),
               "transformers_fraction_of_bound": median("transformers_fraction", level)}
              for level in bandwidth_levels(counted)]
    row = {"model": "125M", "params": model.num_parameters(), "new_tokens": n_new, "weight_bytes": weight_bytes,
           "repeats": repeats, "rounds": runs, "steady_rounds": sum(r["steady"] for r in runs),
           "astrai_fraction_of_bound": median("astrai_fraction"),
           "astrai_first_fraction_of_bound": median("astrai_first_fraction"),
           "transformers_fraction_of_bound": median("transformers_fraction"),
           "astrai_decode_fraction_of_bound": median("astrai_decode_fraction"),
           "transformers_decode_fraction_of_bound": median("transformers_decode_fraction"),
           "astrai_tok_s": median("astrai_tok_s"), "transformers_tok_s": median("transformers_tok_s"),
           "ratio": statistics.median(r["ratio"] for r in runs),
           "copy_bandwidth_gb_s": median("copy_gb_s"), "read_bandwidth_gb_s": median("read_gb_s"),
           "same_tokens": all(r["same_tokens"] for r in runs), "levels": levels}
    for r in runs:
        print(f"[bound] round: copy {r['copy_gb_s']:.1f} GB/s{'' if r['steady'] else ' (level changed)'}, "
              f"astrai {r['astrai_tok_s']:.1f} tok/s = {r['astrai_fraction']:.2f} (decode alone "
              f"{r['astrai_decode_fraction']:.2f}, first run {r['astrai_first_fraction']:.2f}), transformers {r['transformers_tok_s']:.1f} tok/s = "
              f"{r['transformers_fraction']:.2f} ({r['transformers_decode_fraction']:.2f})", flush=True)
    print(f"[bound] 125M, best of {repeats} runs per side in each round, median of {len(counted)} steady rounds of {len(runs)}: copy {row['copy_bandwidth_gb_s']:.1f} "
          f"GB/s (read-only {row['read_bandwidth_gb_s']:.1f}); astrai {row['astrai_tok_s']:.1f} tok/s = "
          f"{row['astrai_fraction_of_bound']:.2f} of the bound (first runs {row['astrai_first_fraction_of_bound']:.2f}), transformers {row['transformers_tok_s']:.1f} tok/s = "
          f"{row['transformers_fraction_of_bound']:.2f}; decode alone (after the first token) "
          f"{row['astrai_decode_fraction_of_bound']:.2f} and {row['transformers_decode_fraction_of_bound']:.2f}; "
          f"astrai against transformers {row['ratio']:.2f}x (median of all "
          f"rounds); identical greedy tokens: {row['same_tokens']}", flush=True)
    if len(levels) > 1:
        print("[bound] per bandwidth level: " + "; ".join(
            f"{lv['copy_gb_s']:.0f} GB/s ({lv['rounds']} rounds): astrai {lv['astrai_fraction_of_bound']:.2f} "
            f"(decode alone {lv['astrai_decode_fraction_of_bound']:.2f}, first runs "
            f"{lv['astrai_first_fraction_of_bound']:.2f}), transformers "
            f"{lv['transformers_fraction_of_bound']:.2f}" for lv in levels), flush=True)
    return row


def bandwidth_levels(rounds: list[dict]) -> list[list[dict]]:
    """The rounds grouped by the machine's bandwidth level: sorted by copy bandwidth and cut
    where one round's is over 20% above the one before (levels sit further apart than that,
    the rounds of one level within about 10% of each other)."""
    ordered = sorted(rounds, key=lambda r: r["copy_gb_s"])
    groups = [[ordered[0]]] if ordered else []
    for r in ordered[1:]:
        if r["copy_gb_s"] > 1.2 * groups[-1][-1]["copy_gb_s"]:
            groups.append([])
        groups[-1].append(r)
    return groups


def throughput(n_requests, max_prompt, max_out, rounds=3) -> dict:
    cfg = preset("tiny")
    model, hf = build_pair(cfg)
    rng = random.Random(1)
    lens = [(rng.randint(16, max_prompt), rng.randint(16, max_out)) for _ in range(n_requests)]
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(p)] for p, _ in lens]
    outs = [o for _, o in lens]
    useful = sum(outs)
    hf_generate(hf, prompts[:16], 4)
    hf_times, our_times = [], []
    with InferenceEngine(model, None, max_batch_size=64, page_size=16, max_seq_len=1024) as engine:
        engine_generate(engine, prompts[:16], 4)
        for _ in range(rounds):  # alternate, keep each side's best: load bursts hit both sides
            hf_times.append(sum(hf_generate(hf, prompts[i:i + 16], max(outs[i:i + 16]))[1]
                                for i in range(0, n_requests, 16)))
            engine.scheduler.clear_prefix_cache()  # else earlier runs' pages would spare prompts their prefill
            our_times.append(engine_generate(engine, prompts, outs)[1])
        stats = engine.get_stats()
    hf_time, ours = min(hf_times), min(our_times)
    row = {"model": "tiny", "requests": n_requests, "output_tokens": useful, "astrai_tok_s": useful / ours,
           "transformers_tok_s": useful / hf_time, "ratio": hf_time / ours, "preemptions": stats["preemptions"],
           "astrai_seconds": our_times, "transformers_seconds": hf_times}
    print(f"[throughput] {n_requests} mixed requests: astrai {row['astrai_tok_s']:.0f} tok/s, transformers static "
          f"batches of 16 {row['transformers_tok_s']:.0f} tok/s, ratio {row['ratio']:.2f}x (best of {rounds} "
          f"alternating runs each; per-run ratios {', '.join(f'{h / o:.2f}' for h, o in zip(hf_times, our_times))})",
          flush=True)
    return row


def shared_prefix_ttft(n_requests=16, system_len=1000, repeats=4) -> dict:
    cfg = preset("tiny", max_len=2048)
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).eval()
    rng = random.Random(2)
    system = [rng.randrange(cfg.vocab_size) for _ in range(system_len)]
    prompts = [system + [rng.randrange(cfg.vocab_size) for _ in range(16)] for _ in range(n_requests)]
    row = {"model": "tiny", "requests": n_requests, "system_tokens": system_len}
    engines = {label: InferenceEngine(model, None, max_batch_size=16, page_size=16, prefix_cache=enabled)
               for label, enabled in (("off", False), ("on", True))}
    outputs = {}
    for label, engine in engines.items():
        engine_generate(engine, [prompts[0][:300]], 2)  # warm-up on an unrelated prefix length
    for _ in range(repeats):  # alternate, keep each side's best: load bursts hit both sides
        for label, engine in engines.items():
            engine.scheduler.clear_prefix_cache()
            outputs[label], _, ttfts = engine_generate(engine, prompts, 4)
            best = row.get(f"ttft_avg_s_{label}", float("inf"))
            row[f"ttft_avg_s_{label}"] = min(best, sum(ttfts) / len(ttfts))
    for engine in engines.values():
        engine.shutdown()
    row["outputs_off"], row["outputs_on"] = outputs["off"], outputs["on"]
    row["ratio"] = row["ttft_avg_s_off"] / row["ttft_avg_s_on"]
    row["same_outputs"] = row.pop("outputs_off") == row.pop("outputs_on")
    print(f"[ttft] shared {system_len}-token prefix: off {row['ttft_avg_s_off'] * 1000:.0f} ms, on "
          f"{row['ttft_avg_s_on'] * 1000:.0f} ms, ratio {row['ratio']:.1f}x, identical outputs {row['same_outputs']}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="single,bound,throughput,ttft")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and requests (a smoke run)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bound-rounds", type=int, default=8,
                        help="rounds of the bound part (more catch each of the machine's bandwidth levels)")
    parser.add_argument("--bound-repeats", type=int, default=3,
                        help="decodes per side in each round of the bound part, the best counted")
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()
    if args.bound_rounds < 1 or args.bound_repeats < 1:
        parser.error("--bound-rounds and --bound-repeats must be at least 1")
    torch.set_num_threads(args.threads)
    tune_process()  # as the CLI verbs do; it applies to both sides of every comparison
    parts = set(args.parts.split(","))
    results = {"threads": args.threads, "torch": torch.__version__}
    n_new = 32 if args.quick else 128
    if "single" in parts:
        results["single"] = [single_request(name, preset(name), n_new) for name in ("tiny", "small")]
    if "bound" in parts:
        results["bound_125m"] = bandwidth_bound(16 if args.quick else 48, rounds=2 if args.quick else args.bound_rounds,
                                                repeats=1 if args.quick else args.bound_repeats)
    if "throughput" in parts:
        results["throughput"] = throughput(16 if args.quick else 64, 128 if args.quick else 512, 64 if args.quick else 256,
                                           rounds=1 if args.quick else 3)
    if "ttft" in parts:
        results["ttft_shared_prefix"] = shared_prefix_ttft()
    write_result("generate", results, args.out)


if __name__ == "__main__":
    main()
