"""A trained draft head on held-out chat prompts: acceptance per draft position and its cost.

Acceptance replays greedy speculative decoding (astrai/eval/draft_acceptance.py) over the
target's own greedy replies to the user turns of data/sft/valid.jsonl (held out from
training), which the engine decodes. Cost: microseconds per draft token (the head alone,
one row, ``k`` tokens a call) against one target decode step at batch 1, the step's time
taken as (time for 65 tokens - time for 1 token) / 64 through the engine, in fp32 and int8.
The head is timed as the CPU engine runs a lone row's drafts (one C call for all k, fp32 beside an
fp32 target, int8 blocks beside a quantized one; ``fused_draft_us_per_token``), through its
modules laid out for the serving kernels, and with torch's own linears. The times are of a hot
head, which in the engine comes from memory after each target step.

    OMP_NUM_THREADS=2 .venv/bin/python bench/draft_head.py --target ~/.cache/astrai/bench-models/smollm2/hf \\
        --head ~/.cache/astrai/draft-heads/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.backends.cpu.fused_head import FusedHead  # noqa: E402
from astrai.backends.cpu.serving import prepare_for_serving  # noqa: E402
from astrai.eval.draft_acceptance import draft_acceptance  # noqa: E402
from astrai.inference import InferenceEngine  # noqa: E402
from astrai.model import AutoModel  # noqa: E402
from astrai.model.draft_head import load_draft_head  # noqa: E402
from astrai.tokenize import AutoTokenizer  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

HELD_OUT = ROOT / "data" / "sft" / "valid.jsonl"


def held_out_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` user turns of the held-out chat file, rendered for the assistant's reply."""
    prompts = []
    for line in HELD_OUT.read_text(encoding="utf-8").splitlines()[:count]:
        user = [m for m in json.loads(line)["messages"] if m["role"] == "user"][:1]
        text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def greedy_replies(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = engine.make_params(max_tokens=new_tokens, temperature=0.0)
    handles = [engine.submit(p, params) for p in prompts]
    return [list(h.result().token_ids) for h in handles]


def decode_step_seconds(engine: InferenceEngine, prompt: list[int], repeats: int = 3) -> float:
    """One batch-1 decode step: the time for 65 tokens less the time for 1, over 64."""
    def timed(tokens: int) -> float:
        params = engine.make_params(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        engine.submit(prompt, params).result()
        return time.perf_counter() - start

    timed(8)
    return min((timed(65) - timed(1)) / 64 for _ in range(repeats))


def draft_token_seconds(head, k: int, calls: int = 200) -> float:
    hidden = torch.randn(head.config.dim)
    token = int(head.draft_ids[0])
    head.draft(hidden, token, k)
    start = time.perf_counter()
    for _ in range(calls):
        head.draft(hidden, token, k)
    return (time.perf_counter() - start) / (calls * k)


def fused_token_seconds(call: FusedHead, head, k: int, calls: int = 200) -> float:
    hidden = torch.randn(head.config.dim)
    token = int(head.draft_ids[0])
    call(hidden, token, k)
    start = time.perf_counter()
    for _ in range(calls):
        call(hidden, token, k)
    return (time.perf_counter() - start) / (calls * k)


def stage(name: str, start: float) -> None:
    print(f"[draft_head] {name} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="the target model directory the head was trained for")
    parser.add_argument("--head", required=True, help="the draft head directory (<ckpt_dir>/final of the run)")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    target = AutoModel.from_pretrained(args.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    head = load_draft_head(args.head, target)
    prompts = held_out_prompts(tokenizer, args.prompts)
    engine = InferenceEngine(target, tokenizer)
    try:
        replies = greedy_replies(engine, prompts, args.new_tokens)
        stage("greedy replies", start)
        step_fp32 = decode_step_seconds(engine, prompts[0])
    finally:
        engine.shutdown()
    int8 = InferenceEngine.from_pretrained(args.target, quantize="int8")
    try:
        step_int8 = decode_step_seconds(int8, prompts[0])
    finally:
        int8.shutdown()
    stage("decode steps timed", start)
    acceptance = draft_acceptance(head, prompts, replies, args.k)
    torch_seconds = draft_token_seconds(head, args.k)
    served = load_draft_head(args.head, target)
    prepare_for_serving(served)  # as the CPU engine lays it out (HeadDrafter.prepare)
    draft_seconds = draft_token_seconds(served, args.k)
    # what the engine runs for a lone row: every draft token in one C call, fp32 beside an fp32
    # target and int8 blocks beside a quantized one
    fused = {}
    for name, quantize in (("fp32", False), ("int8", True)):
        head_as_served = load_draft_head(args.head, target)
        if quantize:
            head_as_served.quantize()
        prepare_for_serving(head_as_served)
        call = FusedHead.for_head(head_as_served)
        if call is not None:
            fused[name] = round(fused_token_seconds(call, head_as_served, args.k) * 1e6, 1)
    stage("heads measured", start)
    shapes = {k: v for k, v in head.config.to_dict().items() if k != "target_fingerprint"}
    results = {"target": str(args.target), "head": str(args.head), "head_config": shapes,
               "prompts": len(prompts), "reply_tokens": sum(map(len, replies)), "acceptance": acceptance.to_dict(),
               "draft_us_per_token": round(draft_seconds * 1e6, 1),
               "draft_us_per_token_torch_linears": round(torch_seconds * 1e6, 1),
               "fused_draft_us_per_token": fused,
               "target_step_ms": {"fp32": round(step_fp32 * 1e3, 2), "int8": round(step_int8 * 1e3, 2)},
               "draft_token_vs_step": {"fp32": round(draft_seconds / step_fp32, 4),
                                       "int8": round(draft_seconds / step_int8, 4)},
               "threads": args.threads}
    print(json.dumps(results, indent=2))
    write_result("draft_head", results)


if __name__ == "__main__":
    main()
