"""One sampling step of a batch (logits → next tokens) against `transformers`' logits warpers.

The engine samples every decode step of every request with temperature > 0, so at batch 64
this step sits beside the model's forward in every GRPO rollout and every sampled serving
batch. astrai's side is what the engine's executor runs: ``SamplingPipeline.for_rows`` (one
row's settings per request, strategies no row uses left out) and ``draw`` (the exponential
race, one generator per seeded request). The reference is the step `transformers`'
``generate`` runs when sampling: its Temperature/TopK/TopP warpers, a softmax and
``torch.multinomial``, with one setting for the whole batch (it has no per-row settings).
Both sides get the same logits, threads and settings; best of ``--repeats`` timings each,
alternating sides. Three settings: temperature 1 alone (GRPO's default), temperature 0.8
with top-k 50 and top-p 0.95 (a common chat setting), and temperature 0.7 with top-p 0.95
alone (the chat page's default), where top-p has the whole vocabulary to rank.

    OMP_NUM_THREADS=2 .venv/bin/python bench/sampling.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.inference.sampling import SamplingPipeline, draw  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

SETTINGS = {"temperature 1": dict(temperature=1.0, top_k=0, top_p=1.0),
            "T 0.8, top-k 50, top-p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
            "T 0.7, top-p 0.95": dict(temperature=0.7, top_k=0, top_p=0.95)}


def astrai_step(logits: torch.Tensor, setting: dict, generators: list) -> torch.Tensor:
    rows = logits.shape[0]
    pipeline = SamplingPipeline.for_rows([setting["temperature"]] * rows, [setting["top_k"]] * rows,
                                         [setting["top_p"]] * rows, [0.0] * rows, logits.device)
    return draw(pipeline.apply(logits).softmax(dim=-1), generators)


def transformers_step(logits: torch.Tensor, setting: dict, warpers) -> torch.Tensor:
    scores = warpers(None, logits)
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)


def make_warpers(setting: dict):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    warpers = LogitsProcessorList()
    if setting["temperature"] != 1.0:
        warpers.append(TemperatureLogitsWarper(setting["temperature"]))
    if setting["top_k"] > 0:
        warpers.append(TopKLogitsWarper(setting["top_k"]))
    if setting["top_p"] < 1.0:
        warpers.append(TopPLogitsWarper(setting["top_p"]))
    return warpers


def best_time(fn, repeats: int, inner: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()

    torch.manual_seed(0)
    results = []
    for vocab in args.vocab:
        logits = torch.randn(args.batch, vocab) * 3
        for name, setting in SETTINGS.items():
            seeded = [torch.Generator().manual_seed(i) for i in range(args.batch)]
            warpers = make_warpers(setting)
            sides = {"astrai (seeded rows)": lambda: astrai_step(logits, setting, seeded),
                     "astrai (unseeded)": lambda: astrai_step(logits, setting, None),
                     "transformers": lambda: transformers_step(logits, setting, warpers)}
            for fn in sides.values():  # warm up every shape before timing
                fn()
            times = {side: float("inf") for side in sides}
            for _ in range(args.repeats):  # alternate, keep each side's best
                for side, fn in sides.items():
                    times[side] = min(times[side], best_time(fn, 1, args.inner))
            ratio_seeded = times["transformers"] / times["astrai (seeded rows)"]
            ratio_unseeded = times["transformers"] / times["astrai (unseeded)"]
            print(f"batch {args.batch} x vocab {vocab}, {name}: " + ", ".join(
                f"{side} {t * 1e3:.2f} ms" for side, t in times.items())
                + f"; speed-up {ratio_seeded:.2f}x seeded, {ratio_unseeded:.2f}x unseeded")
            results.append({"batch": args.batch, "vocab": vocab, "setting": name,
                            "ms": {side: t * 1e3 for side, t in times.items()},
                            "speedup_seeded": ratio_seeded, "speedup_unseeded": ratio_unseeded})
    write_result("sampling", {"rows": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
