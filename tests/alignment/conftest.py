"""Fixtures for the alignment tests: the bundled preference pairs, and data preprocessed for the CLI tests."""

from __future__ import annotations

import json
import random

import pytest

import astrai.alignment  # noqa: F401  registers dpo, rm, grpo and kl with StrategyFactory
from astrai.cli import main


@pytest.fixture(scope="session")
def preference_records(bundled_data):
    """The bundled pairs, shuffled once with a fixed seed (train and held-out slices come from this)."""
    with open(bundled_data / "dpo" / "train.jsonl", encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    random.Random(0).shuffle(records)
    return records


@pytest.fixture(scope="session")
def prepared(bundled_data, tokenizer_dir, tmp_path_factory):
    """Preference pairs (dpo) and arithmetic prompts (grpo), preprocessed for the CLI tests."""
    out = tmp_path_factory.mktemp("align")
    pairs = out / "pairs.jsonl"
    pairs.write_text("".join((bundled_data / "dpo" / "train.jsonl").read_text(encoding="utf-8").splitlines(True)[:64]),
                     encoding="utf-8")
    assert main(["preprocess", str(pairs), "-o", str(out / "dpo"), "--tokenizer", str(tokenizer_dir),
                 "--train_type", "dpo", "--seq_len", "64", "--quiet"]) == 0
    assert main(["preprocess", str(bundled_data / "grpo" / "arithmetic.jsonl"), "-o", str(out / "grpo"),
                 "--tokenizer", str(tokenizer_dir), "--train_type", "grpo", "--seq_len", "48", "--quiet"]) == 0
    return out


def _preprocess_head(prepared, bundled_data, tokenizer_dir, kind: str, lines: int):
    source = prepared / f"{kind}.jsonl"
    source.write_text("".join((bundled_data / ("pretrain" if kind == "seq" else kind) / "train.jsonl")
                              .read_text(encoding="utf-8").splitlines(True)[:lines]), encoding="utf-8")
    assert main(["preprocess", str(source), "-o", str(prepared / kind), "--tokenizer", str(tokenizer_dir),
                 "--train_type", kind, "--quiet"]) == 0
    return prepared / kind


@pytest.fixture(scope="session")
def seq_data(prepared, bundled_data, tokenizer_dir):
    return _preprocess_head(prepared, bundled_data, tokenizer_dir, "seq", 40)


@pytest.fixture(scope="session")
def sft_data(prepared, bundled_data, tokenizer_dir):
    return _preprocess_head(prepared, bundled_data, tokenizer_dir, "sft", 40)
