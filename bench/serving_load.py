"""A load test for OpenAI-compatible servers: many streamed ``/v1/completions`` requests at once.

Every request sends token ids (no tokenizer differences between servers), greedy, with
``ignore_eos`` so each produces exactly its ``max_tokens``. Output tokens/s is the sum of
those over the wall time from the first request sent to the last one finished; the time
to first token of each request is when its first streamed event with a choice arrives.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx


def mixed_requests(n: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                   seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, max_tokens) pairs of uniformly mixed lengths; ids avoid the lowest
    1,000 ids, where tokenizers keep their special tokens."""
    rng = random.Random(seed)
    return [([rng.randrange(1000, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
               start: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    first = None
    events = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            if json.loads(line[5:]).get("choices"):
                events += 1
                if first is None:
                    first = time.perf_counter() - start
    return {"ttft_s": first, "done_s": time.perf_counter() - start, "events": events}


async def _run(base_url: str, model: str, requests: list[tuple[list[int], int]]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(_one(client, base_url + "/v1/completions", model, p, n, start)
                                      for p, n in requests))


def run_load(base_url: str, model: str, requests: list[tuple[list[int], int]]) -> dict:
    """Send all ``requests`` at once; output tokens/s and time-to-first-token percentiles."""
    results = asyncio.run(_run(base_url, model, requests))
    wall = max(r["done_s"] for r in results)
    output_tokens = sum(n for _, n in requests)
    ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    return {"requests": len(requests), "output_tokens": output_tokens, "seconds": wall,
            "output_tok_s": output_tokens / wall,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p95_s": statistics.quantiles(ttfts, n=20, method="inclusive")[-1] if len(ttfts) > 1 else None,
            "streamed_events": sum(r["events"] for r in results)}
