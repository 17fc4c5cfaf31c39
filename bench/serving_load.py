"""A load test for OpenAI-compatible servers: many streamed ``/v1/completions`` requests at once.

Every request sends token ids (no tokenizer differences between servers), greedy, with
``ignore_eos`` so each produces exactly its ``max_tokens``. Output tokens/s is the sum of
those over the wall time from the first request sent to the last one finished; the time
to first token of each request runs from its sending to its first streamed event with a choice.
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


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                            start: float, **fields) -> dict:
    """One streamed greedy completion of ``prompt``; ``fields`` join the body (``cache_prompt`` for
    llama-server). Times are seconds since ``start``, the time to first token since sending;
    ``completion_tokens`` is the server's count when it streams usage (else None)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, **fields}
    sent = time.perf_counter()
    first = usage = None
    events = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices"):
                events += 1
                if first is None:
                    first = time.perf_counter() - sent
    return {"sent_s": sent - start, "ttft_s": first, "done_s": time.perf_counter() - start, "events": events,
            "completion_tokens": (usage or {}).get("completion_tokens")}


def ttft_percentiles(ttfts: list[float]) -> dict:
    """p50 and p95 of times to first token (None where too few to say)."""
    ttfts = sorted(ttfts)
    return {"ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p95_s": statistics.quantiles(ttfts, n=20, method="inclusive")[-1] if len(ttfts) > 1 else None}


async def _run(base_url: str, model: str, requests: list[tuple[list[int], int]]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(stream_completion(client, base_url + "/v1/completions", model, p, n, start)
                                      for p, n in requests))


def run_load(base_url: str, model: str, requests: list[tuple[list[int], int]]) -> dict:
    """Send all ``requests`` at once; output tokens/s and time-to-first-token percentiles."""
    results = asyncio.run(_run(base_url, model, requests))
    wall = max(r["done_s"] for r in results)
    output_tokens = sum(n for _, n in requests)
    return {"requests": len(requests), "output_tokens": output_tokens, "seconds": wall,
            "output_tok_s": output_tokens / wall,
            **ttft_percentiles([r["ttft_s"] for r in results if r["ttft_s"] is not None]),
            "streamed_events": sum(r["events"] for r in results)}
