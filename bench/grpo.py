"""Benchmark one online GRPO step: rollout, scoring and update, and the rollout's engine efficiency.

The reference is the same InferenceEngine used standalone in the same run: the same
prompts, group size and sampling settings submitted straight to ``engine.submit``.
The rollout should reach at least 80% of that throughput (the engine is built once
and only its weights are refreshed between steps).

    OMP_NUM_THREADS=2 .venv/bin/python bench/grpo.py --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.alignment.grpo import GRPOStrategy  # noqa: E402
from astrai.config import preset  # noqa: E402
from astrai.dataset.arithmetic import make_problems  # noqa: E402
from astrai.inference import SamplingParams  # noqa: E402
from astrai.model import AutoModel  # noqa: E402
from astrai.tokenize import AutoTokenizer  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)


def corpus(limit: int = 600):
    with open(ROOT / "data" / "pretrain" / "train.jsonl", encoding="utf-8") as handle:
        for i, line in enumerate(handle):
            if i >= limit:
                break
            yield json.loads(line)["text"]


def standalone_tokens_per_s(engine, prompts, group_size, max_new_tokens, temperature, seed) -> float:
    """The engine on its own: every request submitted at once, generated tokens per second."""
    start = time.perf_counter()
    handles = [engine.submit(list(p), SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                                     seed=seed + i))
               for i, p in enumerate(q for q in prompts for _ in range(group_size))]
    tokens = sum(len(h.result().token_ids) for h in handles)
    return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.train(corpus(), 1000, show_progress=False)
    torch.manual_seed(0)
    model = AutoModel.from_config(preset(args.preset, vocab_size=tokenizer.vocab_size)).to(args.device)
    # an untrained model almost never samples end-of-sequence, so both sides generate ~max_new_tokens per request
    strategy = GRPOStrategy(model, args.device, group_size=args.group_size, reward="arithmetic", tokenizer=tokenizer,
                            max_new_tokens=args.max_new_tokens, temperature=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    problems = make_problems(args.prompts * (args.steps + 1), seed=0)
    prompts = [tokenizer.encode(p["prompt"]) for p in problems]

    rows = []
    try:
        for step in range(args.steps + 1):  # step 0 warms up
            batch = prompts[step * args.prompts:(step + 1) * args.prompts]
            engine_tps = standalone_tokens_per_s(strategy.rollout.engine, batch, args.group_size, args.max_new_tokens,
                                                 1.0, seed=10_000 * step)
            rollout, rewards, scoring_s = strategy.sample(batch)
            start = time.perf_counter()
            loss = strategy.policy_loss(rollout.input_ids, rollout.response_mask, rewards)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            strategy.after_optimizer_step()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            update_s = time.perf_counter() - start
            row = {"rollout_s": rollout.seconds, "scoring_s": scoring_s, "update_s": update_s,
                   "rollout_tokens": rollout.num_response_tokens,
                   "rollout_tokens_per_s": rollout.num_response_tokens / rollout.seconds,
                   "engine_tokens_per_s": engine_tps}
            if step > 0:
                rows.append(row)
                print(f"step {step}: rollout {row['rollout_s']:.3f}s ({row['rollout_tokens_per_s']:.0f} tok/s), "
                      f"scoring {scoring_s * 1000:.1f}ms, update {update_s:.3f}s; engine alone {engine_tps:.0f} tok/s")
    finally:
        strategy.close()

    def median(key):
        return statistics.median(r[key] for r in rows)

    ratio = median("rollout_tokens_per_s") / median("engine_tokens_per_s")
    result = {
        "preset": args.preset, "device": args.device, "params": model.num_parameters(), "steps": args.steps,
        "prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
        "median_rollout_s": median("rollout_s"), "median_scoring_s": median("scoring_s"),
        "median_update_s": median("update_s"), "rollout_tokens_per_s": median("rollout_tokens_per_s"),
        "engine_tokens_per_s": median("engine_tokens_per_s"), "rollout_vs_engine": ratio, "target": 0.8,
        "per_step": rows,
    }
    write_result("grpo", result, args.out)
    print(f"rollout at {ratio:.0%} of the standalone engine's throughput (target >= 80%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
