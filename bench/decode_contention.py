"""Benchmark: decode tokens/s while another process competes for the cores.

A busy loop (``python -c 'while True: pass'``) takes one core; a team of OpenMP threads whose
barriers spin holds its cores while a displaced member waits for a time slice. Measured, in
quiet and busy rounds that alternate inside each worker, for a single greedy request (the
fused C decode step) and for four requests decoded as one batch:

- ``native``: astrai's C kernels (the default);
- ``torch``: PyTorch's own matmuls (``ASTRAI_NATIVE_KERNELS=0``), the reference;
- ``native@<path>``, with ``--baseline PATH``: the C kernels of another checkout (the kernels
  before a change), for an A/B of the same thing in the same run.

Each configuration runs in its own process (the kernels are loaded once per process), the
configurations alternate round by round, and each keeps its best figure per condition, so
that load from elsewhere does not land on one side only. On a shared machine the figures
are noisy: compare ratios from one run.

Usage: .venv/bin/python bench/decode_contention.py [--rounds 1] [--threads 2] [--baseline PATH]
Writes a dated JSON file to bench/results/ (see results_file.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("quiet", "busy")
PROMPT_LEN, SINGLE_TOKENS, BATCH_ROWS, BATCH_TOKENS = 16, 32, 4, 16


def measure(rounds: int, threads: int) -> dict:
    """In a worker: {condition: {"single": best tok/s, "batch": best tok/s}} over ``rounds`` of each."""
    import torch

    from astrai.config import preset
    from astrai.inference import InferenceEngine, SamplingParams
    from astrai.model import AutoModel

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("small", vocab_size=8000, n_layers=6)).eval()
    prompt = [random.Random(0).randrange(8000) for _ in range(PROMPT_LEN)]

    def rate(engine, rows: int, tokens: int) -> float:
        engine.scheduler.clear_prefix_cache()
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        handles = [engine.submit([(t + i) % 8000 for t in prompt], params) for i in range(rows)]
        for handle in handles:
            handle.result()
        return rows * tokens / (time.perf_counter() - start)

    best = {c: {"single": 0.0, "batch": 0.0} for c in CONDITIONS}
    with InferenceEngine(model, None, max_batch_size=BATCH_ROWS, num_pages=64, page_size=16) as engine:
        rate(engine, 1, 8)
        rate(engine, BATCH_ROWS, 8)
        for _ in range(rounds):
            for condition in CONDITIONS:
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "busy" else None
                try:
                    time.sleep(0.2)
                    best[condition]["single"] = max(best[condition]["single"], rate(engine, 1, SINGLE_TOKENS))
                    best[condition]["batch"] = max(best[condition]["batch"], rate(engine, BATCH_ROWS, BATCH_TOKENS))
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
    return best


def run_worker(tree: Path, env_extra: dict, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads), **env_extra)
    out = subprocess.run([sys.executable, __file__, "--worker", "--threads", str(threads)], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", help="another checkout whose C kernels to compare (its root directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(1, args.threads)))
        return
    configs = {"native": (ROOT, {}), "torch": (ROOT, {"ASTRAI_NATIVE_KERNELS": "0"})}
    if args.baseline:
        configs[f"native@{args.baseline}"] = (Path(args.baseline).resolve(), {})
    best = {name: {c: {"single": 0.0, "batch": 0.0} for c in CONDITIONS} for name in configs}
    for _ in range(args.rounds):
        for name, (tree, env) in configs.items():
            figures = run_worker(tree, env, args.threads)
            for condition in CONDITIONS:
                for kind in ("single", "batch"):
                    best[name][condition][kind] = max(best[name][condition][kind], figures[condition][kind])
    for name, figures in best.items():
        line = ", ".join(f"{c} {k} {figures[c][k]:.1f}" for c in CONDITIONS for k in ("single", "batch"))
        ratios = ", ".join(f"{c} {k} {figures[c][k] / best['torch'][c][k]:.2f}x"
                           for c in CONDITIONS for k in ("single", "batch"))
        print(f"{name}: tok/s {line}; vs torch {ratios}")
    sys.path.insert(0, str(ROOT / "bench"))
    from results_file import write_result

    write_result("decode_contention", {"threads": args.threads, "rounds": args.rounds, "tokens_per_s": best,
                                       "model": "small preset, vocab 8000, 6 layers, fp32",
                                       "single_tokens": SINGLE_TOKENS, "batch": [BATCH_ROWS, BATCH_TOKENS]})


if __name__ == "__main__":
    main()
