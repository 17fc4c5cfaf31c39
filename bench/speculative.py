"""Speculative decoding: astrai with and without it, and against llama.cpp's own, one stream.

Workloads (SmolLM2-135M-Instruct, or with ``--model llama1b`` the Llama-1B shape with random
weights and SmolLM2's tokenizer; greedy, the chat template applied):
- ``rewrite``: "repeat this passage" over held-out bundled English text (data/pretrain/valid_en.jsonl),
  the case prompt lookup is for: the answer repeats much of the prompt;
- ``chat``: the bundled SFT conversations' held-out user turns (data/sft/valid.jsonl), where the
  answer repeats little.

For each prompt, in one run and alternating (``--rounds`` passes, odd ones in reverse order):
astrai without speculation, astrai with prompt lookup (``--speculative ngram``), optionally a
draft model or head (``--draft DIR``), and llama.cpp's ``llama-lookup`` on the same weights (GGUF of the same type) with the same draft
length. ``--draft-format int4`` drafts with a draft model that llama.cpp can run too: the target
itself in that format (astrai: the target quantized and saved as ``astrai model quantize --to
int4 --calibration none`` writes it; llama.cpp: the same model's Q4_0 GGUF), and adds
``llama-speculative`` with it as ``-md``. Replies end at the end-of-turn token, as a user sees them (``--ignore-eos`` decodes
``--new-tokens`` past it). Decode tokens/s is (tokens - 1) / (time after the first token) for
astrai, each prompt's and over all prompts' tokens together, and llama-lookup's own
"decoded ... t/s" line. Prints the ratios, writes dated JSON to bench/results/.

Usage: .venv/bin/python bench/speculative.py [--model smollm2] [--precision int8] [--workloads rewrite,chat]
       [--prompts 4] [--rounds 1] [--new-tokens 192] [--draft-tokens 4] [--draft DIR | --draft-format int4]
       [--no-llamacpp] [--ignore-eos]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from llamacpp_models import GGUF_TYPES, MODELS, MODELS_DIR, build_llamacpp, ensure_gguf, ensure_hf  # noqa: E402
from results_file import write_result  # noqa: E402

from astrai.inference import InferenceEngine, SamplingParams  # noqa: E402
from astrai.model import AutoModel  # noqa: E402
from astrai.model.quantized import quantize_model  # noqa: E402
from astrai.tokenize import AutoTokenizer  # noqa: E402

PASSAGE_CHARS = 900


def rewrite_prompts(n: int) -> list[list[dict]]:
    texts = [json.loads(line)["text"] for line in (ROOT / "data/pretrain/valid_en.jsonl").open(encoding="utf-8")]
    passages = []
    for text in texts:
        for start in range(0, len(text) - PASSAGE_CHARS, 4 * PASSAGE_CHARS):
            cut = text[start:start + PASSAGE_CHARS]
            passages.append(cut[:cut.rfind(". ") + 1] if ". " in cut else cut)
    return [[{"role": "user", "content": f"Repeat the following text exactly, word for word.\n\n{p}"}]
            for p in passages[:n]]


def chat_prompts(n: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in (ROOT / "data/sft/valid.jsonl").open(encoding="utf-8")]
    prompts = [r["messages"][:1] for r in rows if r.get("source", "").startswith("chatterbot-corpus/english")]
    return prompts[:n]


WORKLOADS = {"rewrite": rewrite_prompts, "chat": chat_prompts}


def astrai_decode(engine: InferenceEngine, ids: list[int], n_new: int, ignore_eos: bool = False) -> dict:
    engine.scheduler.clear_prefix_cache()
    before = engine.get_stats().get("speculative", {})
    start = time.perf_counter()
    handle = engine.submit(ids, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=ignore_eos))
    tokens = handle.result().token_ids
    seconds = time.perf_counter() - start
    after = engine.get_stats().get("speculative", {})
    decode_s = seconds - handle.time_to_first_token
    out = {"tok_s": (len(tokens) - 1) / decode_s, "tokens": tokens, "decode_s": decode_s}
    if after:
        drafted = after["drafted_tokens"] - before.get("drafted_tokens", 0)
        out["acceptance"] = (after["accepted_tokens"] - before.get("accepted_tokens", 0)) / drafted if drafted else 0.0
    return out


def llama_speculating(binary: Path, gguf: Path, prompt: str, n_new: int, draft_tokens: int, threads: int,
                      ignore_eos: bool, draft_gguf: Path | None = None) -> dict:
    """One greedy run of llama.cpp's ``llama-lookup`` or, with ``draft_gguf`` drafting,
    ``llama-speculative``, up to ``draft_tokens`` drafted tokens (its other settings its defaults)."""
    draft = [] if draft_gguf is None else ["-md", str(draft_gguf), "-td", str(threads), "-tbd", str(threads)]
    cmd = [str(binary), "-m", str(gguf), *draft, "-p", prompt, "-n", str(n_new), "--spec-draft-n-max",
           str(draft_tokens), "-t", str(threads), "-tb", str(threads), "--temp", "0", "-c", "4096"]
    cmd += ["--ignore-eos"] if ignore_eos else []
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=900)  # a piece of a character
    log = done.stdout + done.stderr
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    accept = re.search(r"accept\s+=\s+([\d.]+)%", log)
    if done.returncode != 0 or speed is None:
        raise RuntimeError(f"{binary.name} failed ({done.returncode}): {log[-2000:]}")
    return {"tok_s": float(speed.group(3)), "tokens": int(speed.group(1)),
            "acceptance": float(accept.group(1)) / 100 if accept else None}


def quantized_copy(model: str, model_dir: Path, fmt: str) -> Path:
    """The target saved in ``fmt`` with Q4_0's / Q8_0's plain rule (the numbers of llama.cpp's
    GGUF of that type), made once."""
    out = MODELS_DIR / model / f"astrai-{fmt}"
    if not (out / "config.json").is_file():
        quantize_model(AutoModel.from_pretrained(model_dir), fmt).save_pretrained(out)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=MODELS)
    parser.add_argument("--precision", default="int8", choices=sorted(GGUF_TYPES))
    parser.add_argument("--workloads", default="rewrite,chat")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over the prompts (odd ones take the systems in reverse order); the speculating "
                             "engines' switches carry what they measured from one pass to the next")
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--draft", default=None, metavar="DIR", help="also run --speculative draft with this draft model")
    parser.add_argument("--draft-format", default=None, choices=["int4", "int8"],
                        help="also run a draft model that is the target in this format, in astrai and in "
                             "llama-speculative (instead of --draft)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="decode --new-tokens past the end of the reply (default: stop there, as a user sees it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.draft and args.draft_format:
        parser.error("--draft and --draft-format name two draft models; give one")
    return args


def open_engine(model_dir: Path, precision: str, **settings) -> InferenceEngine:
    placement = {"dtype": torch.bfloat16} if precision == "bf16" else {} if precision == "fp32" else {"quantize": precision}
    return InferenceEngine.from_pretrained(model_dir, max_batch_size=1, max_seq_len=2048, **placement, **settings)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = ensure_hf(args.model)
    llamacpp = None if args.no_llamacpp else build_llamacpp()
    gguf = None if llamacpp is None else ensure_gguf(args.model, GGUF_TYPES[args.precision], llamacpp)
    draft_gguf = None
    if args.draft_format:
        args.draft = str(quantized_copy(args.model, model_dir, args.draft_format))
        draft_gguf = None if llamacpp is None else ensure_gguf(args.model, GGUF_TYPES[args.draft_format], llamacpp)
    results = {"model": args.model, "precision": args.precision, "draft_tokens": args.draft_tokens, "new_tokens": args.new_tokens,
               "draft": args.draft, "draft_format": args.draft_format,
               "rounds": args.rounds, "threads": args.threads, "workloads": {}}
    for workload in args.workloads.split(","):
        # fresh engines per workload: what the engine learned of drafting on one (how long a
        # row drafts, whether drafting pays) is not carried into the other
        systems = open_systems(model_dir, args)
        tokenizer = systems["plain"].tokenizer
        rows = []
        # each round runs every prompt on every system; odd rounds take the systems in reverse
        # order, so that neither side always follows the other
        for round_index, messages in ((r, m) for r in range(args.rounds) for m in WORKLOADS[workload](args.prompts)):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
            row, tokens = {"prompt_tokens": len(ids), "round": round_index}, {}
            order = list(systems.items())
            for name, engine in order if round_index % 2 == 0 else order[::-1]:
                run = astrai_decode(engine, ids, args.new_tokens, args.ignore_eos)
                row[name] = {k: v for k, v in run.items() if k != "tokens"}
                row[name]["new_tokens"] = len(run["tokens"])
                tokens[name] = run["tokens"]
            row["same_tokens"] = all(t == tokens["plain"] for t in tokens.values())
            if gguf is not None:
                row["llama-lookup"] = llama_speculating(llamacpp.tool("llama-lookup"), gguf, text, args.new_tokens,
                                                        args.draft_tokens, args.threads, args.ignore_eos)
            if draft_gguf is not None:
                row["llama-speculative"] = llama_speculating(llamacpp.tool("llama-speculative"), gguf, text,
                                                             args.new_tokens, args.draft_tokens, args.threads,
                                                             args.ignore_eos, draft_gguf)
            rows.append(row)
            print(f"[{workload}] {len(ids)} prompt tokens: " + ", ".join(
                f"{k} {v['tok_s']:.1f} tok/s" + (f" (acc {v['acceptance']:.2f})" if v.get("acceptance") is not None else "")
                for k, v in row.items() if isinstance(v, dict)) + f"; same tokens: {row['same_tokens']}", flush=True)
        summary, overall = {}, {}
        for name in [k for k in rows[0] if isinstance(rows[0][k], dict)]:
            summary[name] = statistics.median(r[name]["tok_s"] for r in rows)
            if not name.startswith("llama-"):  # every token after each reply's first, over the time they took
                overall[name] = sum(r[name]["new_tokens"] - 1 for r in rows) / sum(r[name]["decode_s"] for r in rows)
        ratios = {f"{name}/plain": summary[name] / summary["plain"] for name in summary if name != "plain"}
        ratios.update({f"{name}/plain, all tokens": overall[name] / overall["plain"] for name in overall if name != "plain"})
        if "llama-lookup" in summary:
            ratios["ngram/llama-lookup"] = summary["ngram"] / summary["llama-lookup"]
        if "llama-speculative" in summary:
            ratios["draft/llama-speculative"] = summary["draft"] / summary["llama-speculative"]
        results["workloads"][workload] = {"rows": rows, "median_tok_s": summary, "all_tokens_tok_s": overall,
                                          "ratios": ratios}
        print(f"[{workload}] median tok/s {json.dumps({k: round(v, 1) for k, v in summary.items()})}; "
              f"ratios {json.dumps({k: round(v, 2) for k, v in ratios.items()})}", flush=True)
        for engine in systems.values():
            engine.shutdown()
    write_result("speculative", results, args.out)


def open_systems(model_dir: Path, args: argparse.Namespace) -> dict[str, InferenceEngine]:
    """The astrai engines compared, each warmed up on one short chat."""
    systems = {"plain": open_engine(model_dir, args.precision),
               "ngram": open_engine(model_dir, args.precision, speculative="ngram", draft_tokens=args.draft_tokens)}
    if args.draft:
        systems["draft"] = open_engine(model_dir, args.precision, draft_model=args.draft, draft_tokens=args.draft_tokens)
    tokenizer = systems["plain"].tokenizer
    warm = tokenizer.apply_chat_template(chat_prompts(1)[0], tokenize=True, add_generation_prompt=True)
    for engine in systems.values():
        astrai_decode(engine, list(warm), 16, True)
    return systems


if __name__ == "__main__":
    main()
