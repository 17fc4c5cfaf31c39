"""Benchmark: what the HTTP layer costs on top of the engine, at 1, 8 and 32 concurrent streams.

One run measures the same workload twice on the same model directory:

1. **engine**: requests submitted straight to ``InferenceEngine`` in this process and read
   with ``handle.aiter()`` by asyncio workers (what the server does, minus HTTP);
2. **http**: the same requests as streaming ``/v1/chat/completions`` calls from an
   asyncio load generator on loopback to ``astrai serve`` running in a subprocess.

For each concurrency it reports requests/s, output tokens/s, p50/p99 time to first
token and p50/p99 inter-token latency, and the HTTP overhead
``1 - http_tok_s / engine_tok_s`` (target: <= 10% at 32 streams). Because wall-clock
throughput on a shared machine is noisy, it also reports CPU time per generated token
of the engine alone (this process) and of the whole server process (engine + HTTP),
and, with an instant stand-in engine behind the real app, the HTTP layer's own CPU
time per streamed token; its share of the server's CPU per token at the engine's cost
is the overhead figure that stays meaningful on a busy machine. Every request
generates exactly ``--max-tokens`` tokens (``ignore_eos``), so both sides do equal work.

Usage: OMP_NUM_THREADS=2 .venv/bin/python bench/serve.py [--model DIR] [--quick]
Without --model a random-weight model of the ``tiny`` preset is built with a tokenizer
trained on the bundled corpus. Writes a dated JSON file to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.inference import InferenceEngine, SamplingParams  # noqa: E402
from astrai.parallel.setup import free_port  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

MODEL_NAME = "bench"
PROMPTS = ["Tell me about the sea.", "讲一个关于月亮的故事。", "List three prime numbers.", "What is a transformer?"]


def build_model_dir(path: Path) -> None:
    """A random-weight tiny-preset model plus a tokenizer trained on the bundled corpus."""
    from astrai.config import preset
    from astrai.model import AutoModel
    from astrai.tokenize import AutoTokenizer

    with open(ROOT / "data" / "pretrain" / "train.jsonl", encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for _, line in zip(range(600), handle)]
    tokenizer = AutoTokenizer.train(iter(texts), 1000, show_progress=False)
    torch.manual_seed(0)
    AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size)).save_pretrained(path)
    tokenizer.save_pretrained(path)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(wall: float, requests: int, tokens: int, ttfts: list[float], gaps: list[float]) -> dict:
    return {"requests": requests, "wall_s": round(wall, 3), "req_per_s": round(requests / wall, 3),
            "output_tok_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 2), "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 2),
            "itl_p50_ms": round(percentile(gaps, 50) * 1000, 2), "itl_p99_ms": round(percentile(gaps, 99) * 1000, 2)}


def workload(concurrency: int, per_stream: int) -> list[tuple[str, int]]:
    return [(PROMPTS[i % len(PROMPTS)], i) for i in range(concurrency * per_stream)]


async def run_engine(engine, tokenizer, concurrency: int, jobs: list[tuple[str, int]], max_tokens: int) -> dict:
    """The same workload straight into the engine: ``concurrency`` asyncio workers reading ``handle.aiter()``."""
    ttfts, gaps, tokens = [], [], [0]
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def one(prompt, seed):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                            add_generation_prompt=True)
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
        start = time.perf_counter()
        first, last, count = None, None, 0
        async for event in engine.submit(list(ids), params).aiter():
            now = time.perf_counter()
            count += len(event.token_ids)
            if event.text:
                if first is None:
                    first = now - start
                elif last is not None:
                    gaps.append(now - last)
                last = now
        ttfts.append(first)
        tokens[0] += count

    async def worker():
        while not queue.empty():
            await one(*queue.get_nowait())

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return summarize(wall, len(jobs), tokens[0], [t for t in ttfts if t is not None], gaps)


async def run_http(url: str, concurrency: int, jobs: list[tuple[str, int]], max_tokens: int) -> dict:
    import httpx

    ttfts, gaps, tokens = [], [], [0]
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def one(client, prompt, seed):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 1.0, "seed": seed, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first, last = None, None
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens[0] += chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    if first is None:
                        first = now - start
                    elif last is not None:
                        gaps.append(now - last)
                    last = now
        ttfts.append(first)

    async def worker(client):
        while not queue.empty():
            await one(client, *queue.get_nowait())

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(wall, len(jobs), tokens[0], [t for t in ttfts if t is not None], gaps)


class InstantEngine:
    """Engine stand-in that emits its tokens as fast as the server can take them.

    Served by the real app in a subprocess, it isolates the HTTP layer's own cost per
    streamed token (parsing, SSE formatting, socket writes), free of model noise.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. 敏捷的狐狸。" * 40)

    def submit(self, prompt_ids, params):
        return _InstantHandle(self, len(prompt_ids), params.max_tokens)

    def get_stats(self) -> dict:
        return {"running": 0}

    def shutdown(self) -> None:
        """Nothing to release."""


class _InstantHandle:
    def __init__(self, engine: InstantEngine, prompt_tokens: int, max_tokens: int):
        self.engine, self.prompt_tokens, self.max_tokens = engine, prompt_tokens, max_tokens

    async def aiter(self):
        from astrai.inference.types import StreamEvent

        ids = self.engine.token_ids[: self.max_tokens]
        decoder = self.engine.tokenizer.stream_decoder()
        for i, token in enumerate(ids):
            await asyncio.sleep(0)
            last = i + 1 == len(ids)
            yield StreamEvent(text=decoder.push(token) + (decoder.flush() if last else ""), token_ids=[token],
                              finished=last, finish_reason="length" if last else None, completion_tokens=i + 1)

    def abort(self) -> None:
        """Nothing runs between events, so there is nothing to stop."""


def serve_instant(model_dir: str, port: int) -> None:
    import uvicorn

    from astrai.serving import create_app
    from astrai.tokenize import AutoTokenizer

    app = create_app(InstantEngine(AutoTokenizer.from_pretrained(model_dir)), model_name=MODEL_NAME)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start_server(cmd: list[str], port: int) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} exited during start-up")
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"{' '.join(cmd)} did not become ready")


def measure_http_layer(model_dir: Path, concurrency: int, args, results: dict) -> dict:
    """Server CPU per streamed token with an instant engine, and what it would cost at the engine's rate."""
    port = free_port()
    server = start_server([sys.executable, str(Path(__file__).resolve()), "--model", str(model_dir),
                           "--instant-server", str(port)], port)
    url = f"http://127.0.0.1:{port}"
    try:
        jobs = workload(concurrency, args.per_stream)
        runs = []
        for _ in range(args.repeats):
            cpu = process_cpu_s(server.pid)
            run = asyncio.run(run_http(url, concurrency, jobs, args.max_tokens))
            run["server_cpu_us_per_token"] = round((process_cpu_s(server.pid) - cpu) * 1e6
                                                   / (len(jobs) * args.max_tokens), 1)
            runs.append(run)
    finally:
        server.terminate()
        server.wait(timeout=30)
    best = min(runs, key=lambda r: r["server_cpu_us_per_token"])
    level = results["levels"].get(str(concurrency))
    out = {"streams": concurrency, "server_cpu_us_per_token": best["server_cpu_us_per_token"],
           "max_output_tok_per_s": max(r["output_tok_per_s"] for r in runs)}
    if level is not None:
        engine_us = level["engine_cpu_ms_per_token"] * 1000
        out["engine_cpu_us_per_token"] = round(engine_us, 1)
        out["http_cpu_share"] = round(best["server_cpu_us_per_token"] / (engine_us + best["server_cpu_us_per_token"]), 4)
    print(f"HTTP layer alone ({concurrency} streams, instant engine): {out['server_cpu_us_per_token']} us CPU per "
          f"token, up to {out['max_output_tok_per_s']:.0f} tok/s"
          + (f"; share of server CPU at the engine's cost per token: {out['http_cpu_share']:.1%}"
             if "http_cpu_share" in out else ""))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: a random tiny-preset model)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--per-stream", type=int, default=2, help="requests each stream sends, one after another")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating engine/HTTP runs per level; the best of each is kept (shared CPUs are noisy)")
    parser.add_argument("--quick", action="store_true", help="16 tokens, one request per stream")
    parser.add_argument("--instant-server", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instant_server is not None:
        serve_instant(args.model, args.instant_server)
        return
    if args.quick:
        args.max_tokens, args.per_stream = 16, 1
    levels = [int(c) for c in args.concurrency.split(",")]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else Path(tmp) / "model"
        if not args.model:
            build_model_dir(model_dir)
        max_seq_len = 512
        results = {"model": str(args.model or "random tiny preset"), "max_tokens": args.max_tokens,
                   "per_stream": args.per_stream, "repeats": args.repeats, "threads": torch.get_num_threads(), "levels": {}}

        port = free_port()
        server = start_server([sys.executable, "-m", "astrai", "serve", "--model", str(model_dir), "--port", str(port),
                               "--served-model-name", MODEL_NAME, "--max-batch-size", str(max(levels)),
                               "--max-seq-len", str(max_seq_len), "--log-level", "warning"], port)
        engine = InferenceEngine.from_pretrained(str(model_dir), max_batch_size=max(levels), max_seq_len=max_seq_len)
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(run_engine(engine, engine.tokenizer, 2, workload(2, 1), 4))  # warm-up
            asyncio.run(run_http(url, 2, workload(2, 1), 4))
            for c in levels:  # engine and HTTP back to back per level, so both see the same machine load
                jobs = workload(c, args.per_stream)
                engine_runs, http_runs = [], []
                for _ in range(args.repeats):
                    cpu = time.process_time()
                    run = asyncio.run(run_engine(engine, engine.tokenizer, c, jobs, args.max_tokens))
                    run["cpu_ms_per_token"] = round((time.process_time() - cpu) * 1000 / (len(jobs) * args.max_tokens), 4)
                    engine_runs.append(run)
                    cpu = process_cpu_s(server.pid)
                    run = asyncio.run(run_http(url, c, jobs, args.max_tokens))
                    run["cpu_ms_per_token"] = round((process_cpu_s(server.pid) - cpu) * 1000
                                                    / (len(jobs) * args.max_tokens), 4)
                    http_runs.append(run)
                eng = max(engine_runs, key=lambda r: r["output_tok_per_s"])
                http = max(http_runs, key=lambda r: r["output_tok_per_s"])
                overhead = 1 - http["output_tok_per_s"] / eng["output_tok_per_s"]
                cpu_engine = min(r["cpu_ms_per_token"] for r in engine_runs)
                cpu_server = min(r["cpu_ms_per_token"] for r in http_runs)
                results["levels"][str(c)] = {"engine": eng, "http": http, "http_overhead": round(overhead, 4),
                                             "engine_cpu_ms_per_token": cpu_engine,
                                             "server_cpu_ms_per_token": cpu_server,
                                             "http_cpu_overhead": round(cpu_server / cpu_engine - 1, 4)}
                print(f"{c:>3} streams | engine {eng['output_tok_per_s']:8.1f} tok/s {eng['req_per_s']:6.2f} req/s "
                      f"ttft p50 {eng['ttft_p50_ms']:7.1f} ms | http {http['output_tok_per_s']:8.1f} tok/s "
                      f"{http['req_per_s']:6.2f} req/s ttft p50 {http['ttft_p50_ms']:7.1f} p99 {http['ttft_p99_ms']:7.1f} "
                      f"ms itl p50 {http['itl_p50_ms']:6.1f} p99 {http['itl_p99_ms']:6.1f} ms | "
                      f"HTTP overhead {overhead:+.1%} (CPU per token {cpu_server / cpu_engine - 1:+.1%})")
        finally:
            engine.shutdown()
            server.terminate()
            server.wait(timeout=30)
        results["http_layer"] = measure_http_layer(model_dir, max(levels), args, results)
    top = results["levels"].get("32")
    if top is not None:
        results["target_overhead_at_32"] = 0.10
        results["meets_target_throughput"] = top["http_overhead"] <= 0.10
        results["meets_target_cpu"] = results["http_layer"].get("http_cpu_share", 1.0) <= 0.10
    write_result("serve", results)


if __name__ == "__main__":
    main()
