"""Forward+backward throughput of astrai's Transformer against transformers' LlamaForCausalLM.

Both models have the same shape and the same weights (astrai's model is exported to
Llama format and loaded by transformers), see the same batches, compute the same
cross-entropy loss outside the model, and run interleaved in one process with the
same thread count. On a shared machine the load drifts, so each round times both
models back to back (alternating which goes first) and the headline ratio is the
median over rounds of that round's time ratio; best-step and median-step ratios are
reported beside it.

    OMP_NUM_THREADS=2 .venv/bin/python bench/forward.py --preset small --batch 4 --seq 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)


def step(forward, ids: torch.Tensor, model: torch.nn.Module) -> None:
    logits = forward(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    model.zero_grad(set_to_none=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per model (interleaved)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()

    import transformers

    from astrai.config import preset
    from astrai.model import AutoModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = preset(args.preset)
    ours = AutoModel.from_config(config).train()
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp, format="llama")
        reference = transformers.LlamaForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))
    with torch.no_grad():
        gap = (ours(ids[:, :-1])["logits"] - reference(ids[:, :-1]).logits).abs().max().item()
    runners = {"astrai": (lambda x: ours(x)["logits"], ours), "transformers": (lambda x: reference(x).logits, reference)}
    for forward, model in runners.values():
        step(forward, ids, model)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_idx in range(args.repeats):
        order = list(runners.items())
        for name, (forward, model) in order if round_idx % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            step(forward, ids, model)
            times[name].append(time.perf_counter() - start)
    tokens = args.batch * args.seq
    tps = {name: tokens / statistics.median(t) for name, t in times.items()}
    best_tps = {name: tokens / min(t) for name, t in times.items()}
    paired = statistics.median(h / a for a, h in zip(times["astrai"], times["transformers"]))
    result = {
        "preset": args.preset, "parameters": ours.num_parameters(), "batch": args.batch, "seq": args.seq,
        "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
        "transformers": transformers.__version__, "max_logit_gap": gap,
        "astrai_tokens_per_s": tps["astrai"], "transformers_tokens_per_s": tps["transformers"],
        "ratio": paired, "best_step_ratio": best_tps["astrai"] / best_tps["transformers"],
        "median_step_ratio": tps["astrai"] / tps["transformers"], "step_seconds": times,
    }
    write_result("forward", result, args.out)
    print(f"{args.preset} ({result['parameters'] / 1e6:.1f}M params), batch {args.batch}x{args.seq}, "
          f"{args.threads} threads, logit gap {gap:.2e}")
    print(f"astrai        {tps['astrai']:9.1f} tokens/s (forward+backward, median step)")
    print(f"transformers  {tps['transformers']:9.1f} tokens/s")
    print(f"ratio         {paired:.3f}x (median of {args.repeats} paired rounds; best step "
          f"{result['best_step_ratio']:.3f}x, median step {result['median_step_ratio']:.3f}x)   → {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
