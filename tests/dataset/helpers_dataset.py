"""Small helpers shared by the dataset tests: write JSONL, run preprocessing."""

from __future__ import annotations

import json
from pathlib import Path

from astrai.dataset import PreprocessOptions, run_preprocess


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in records),
                    encoding="utf-8")
    return path


def preprocess(inputs, output, tokenizer_dir, **options) -> dict:
    opts = PreprocessOptions(inputs=[str(p) for p in inputs], output=str(output), tokenizer=str(tokenizer_dir),
                             show_progress=False, **options)
    return run_preprocess(opts)


def bundled_texts(bundled_data: Path, n: int) -> list[str]:
    with open(bundled_data / "pretrain" / "train.jsonl", encoding="utf-8") as handle:
        return [json.loads(next(handle))["text"] for _ in range(n)]
