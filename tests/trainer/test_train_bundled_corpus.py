"""End to end through the CLI: preprocess the bundled corpus, dry-run, train a tiny model,
and beat the corpus's unigram entropy on held-out windows."""

import json
import math
from collections import Counter

import pytest

from astrai.cli import main
from astrai.dataset import DatasetFactory

MODEL = {"vocab_size": 1000, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "dim_ffn": 192, "max_len": 128}


@pytest.fixture(scope="module")
def corpus(bundled_data, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pt")
    assert main(["preprocess", str(bundled_data / "pretrain" / "train.jsonl"), "-o", str(out / "data"),
                 "--tokenizer", str(tokenizer_dir), "--train_type", "seq"]) == 0
    return out


def unigram_entropy_nats(data_path, window):
    storage = DatasetFactory.load("seq", data_path, window).storage
    counts = Counter(storage.fetch(0, len(storage))["sequence"].tolist())
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def train_args(corpus, tokenizer_dir):
    return ["train", "--train_type", "seq", "--data_root_path", str(corpus / "data"), "--model_preset", "tiny",
            "--model_overrides", json.dumps(MODEL), "--tokenizer_path", str(tokenizer_dir), "--window_size", "64",
            "--batch_per_device", "8", "--max_steps", "300", "--max_lr", "3e-3", "--warmup_ratio", "0.05",
            "--val_fraction", "0.05", "--validation_interval", "100", "--validation_batches", "16",
            "--ckpt_dir", str(corpus / "run"), "--ckpt_interval", "150", "--no-progress_bar"]


def test_dry_run_prints_the_plan(corpus, tokenizer_dir, capsys):
    assert main(train_args(corpus, tokenizer_dir) + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "total steps       300" in out and "tokens per step   512" in out and "memory estimate" in out
    assert not (corpus / "run").exists()


def test_tiny_model_beats_unigram_entropy(corpus, tokenizer_dir):
    assert main(train_args(corpus, tokenizer_dir)) == 0
    records = [json.loads(line) for line in (corpus / "run" / "metrics.jsonl").read_text().splitlines()]
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    entropy = unigram_entropy_nats(corpus / "data", 64)
    print(f"unigram entropy {entropy:.3f} nats/token, final validation loss {val_losses[-1]:.3f}")
    assert len(val_losses) == 3 and val_losses[-1] < val_losses[0]
    assert val_losses[-1] < entropy - 0.5
    assert (corpus / "run" / "metrics.png").stat().st_size > 1000
    assert (corpus / "run" / "final" / "model.safetensors").is_file()
    assert (corpus / "run" / "final" / "tokenizer.json").is_file()
