"""Preprocessing throughput against the bare `tokenizers` batch encoder, and dataset read
rate against what a training step consumes.

1. Tokens per second of the whole `astrai preprocess` pipeline (read JSONL, parse,
   validate, tokenise in batches, lay out, write memory-mapped shards) on the bundled
   pre-training corpus, against `tokenizers.Tokenizer.encode_batch` on the same texts
   already in memory (and against `encode_batch_fast`, the offset-free variant the
   pipeline itself uses for plain text), in the same process with the same threads. Best of
   ``--repeats`` for each (contention only ever adds time). Target ratio >= 0.7.
2. SEQ and SFT `__getitem__` rate (random indices) at window 256, against the items
   per second a training step needs at the quick start's batch (8 x 256), measured by
   timing forward+backward of the tiny preset. Target: >= 10x.

    OMP_NUM_THREADS=2 .venv/bin/python bench/preprocess.py
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

ROOT = Path(__file__).resolve().parent.parent


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def getitem_rate(dataset, n: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    indices = [rng.randrange(len(dataset)) for _ in range(n)]
    start = time.perf_counter()
    for i in indices:
        dataset[i]
    return n / (time.perf_counter() - start)


def train_step_seconds(vocab_size: int, batch: int, window: int, repeats: int) -> float:
    from astrai.config import preset
    from astrai.model import AutoModel

    model = AutoModel.from_config(preset("tiny", vocab_size=vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab_size, (batch, window + 1))

    def step():
        logits = model(ids[:, :-1])["logits"]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    return best_of(repeats, step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(ROOT / "data" / "pretrain" / "train.jsonl"))
    parser.add_argument("--sft", default=str(ROOT / "data" / "sft" / "train.jsonl"))
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()

    from astrai.dataset import DatasetFactory, PreprocessOptions, run_preprocess
    from astrai.tokenize import AutoTokenizer

    texts = [json.loads(line)["text"] for line in open(args.corpus, encoding="utf-8")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = AutoTokenizer.train([args.corpus, args.sft], args.vocab_size, show_progress=False)
        tokenizer.save_pretrained(tmp / "tok")
        backend = tokenizer.backend
        n_tokens = sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)) + len(texts)

        bare_s = best_of(args.repeats, lambda: backend.encode_batch(texts, add_special_tokens=False))
        fast_s = best_of(args.repeats, lambda: backend.encode_batch_fast(texts, add_special_tokens=False))

        def pipeline(train_type="seq", source=args.corpus, out="seq"):
            return run_preprocess(PreprocessOptions(inputs=[source], output=str(tmp / out), tokenizer=str(tmp / "tok"),
                                                    train_type=train_type, show_progress=False))

        pipeline_s = best_of(args.repeats, pipeline)
        stored = pipeline()["tokens"]
        assert stored == n_tokens, (stored, n_tokens)
        pipeline("sft", args.sft, "sft")

        seq = DatasetFactory.load("seq", tmp / "seq", args.window)
        sft = DatasetFactory.load("sft", tmp / "sft", args.window)
        seq_rate, sft_rate = getitem_rate(seq, 5000), getitem_rate(sft, 5000)
        step_s = train_step_seconds(tokenizer.vocab_size, args.batch, args.window, args.repeats)

    needed = args.batch / step_s
    results = {
        "corpus_tokens": n_tokens,
        "threads": torch.get_num_threads(),
        "bare_encode_batch_tokens_per_s": round(n_tokens / bare_s),
        "preprocess_tokens_per_s": round(n_tokens / pipeline_s),
        "preprocess_vs_bare_ratio": round(bare_s / pipeline_s, 3),
        "bare_encode_batch_fast_tokens_per_s": round(n_tokens / fast_s),
        "preprocess_vs_bare_fast_ratio": round(fast_s / pipeline_s, 3),
        "target_ratio": 0.7,
        "seq_getitem_per_s": round(seq_rate),
        "sft_getitem_per_s": round(sft_rate),
        "train_step_s_tiny_8x256": round(step_s, 4),
        "items_needed_per_s": round(needed, 2),
        "seq_getitem_vs_need": round(seq_rate / needed, 1),
        "sft_getitem_vs_need": round(sft_rate / needed, 1),
        "target_getitem_vs_need": 10,
    }
    write_result("preprocess", results, args.out)
    print(json.dumps(results, indent=2))
    print(f"preprocess / bare encode_batch = {results['preprocess_vs_bare_ratio']:.2f}x, / encode_batch_fast = "
          f"{results['preprocess_vs_bare_fast_ratio']:.2f}x (target >= 0.7); "
          f"__getitem__ / step need = {results['seq_getitem_vs_need']:.0f}x (target >= 10)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
