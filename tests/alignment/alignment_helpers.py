"""Helpers shared by the alignment tests: tiny models and preference records as batches."""

from __future__ import annotations

import json

import torch

from astrai.config import preset
from astrai.model import AutoModel

CLI_MODEL = {"vocab_size": 1000, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "dim_ffn": 64, "max_len": 128}
MAX_RESPONSE_TOKENS = 24
MAX_PROMPT_TOKENS = 24


def tiny_lm(vocab_size: int, seed: int = 0, dim: int = 32, n_layers: int = 2):
    torch.manual_seed(seed)
    cfg = preset("tiny", vocab_size=vocab_size, n_layers=n_layers, dim=dim, n_heads=2, n_kv_heads=1,
                 dim_ffn=2 * dim, max_len=128)
    return AutoModel.from_config(cfg)


def encode_pairs(tokenizer, records):
    """Preference records → a DPO batch (right-padded ids, masks 1 on the answer and its end-of-turn)."""
    end_of_turn = tokenizer.stop_ids[-1]
    rows = {"chosen": [], "rejected": []}
    for rec in records:
        prompt = tokenizer.apply_chat_template(rec["prompt"], tokenize=True, add_generation_prompt=True)[-MAX_PROMPT_TOKENS:]
        for side in rows:
            answer = tokenizer.encode(rec[side])[:MAX_RESPONSE_TOKENS] + [end_of_turn]
            rows[side].append((prompt, answer))
    batch = {}
    for side, pairs in rows.items():
        length = max(len(p) + len(a) for p, a in pairs)
        ids = torch.zeros(len(pairs), length, dtype=torch.long)
        mask = torch.zeros(len(pairs), length, dtype=torch.long)
        for i, (p, a) in enumerate(pairs):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            mask[i, len(p):len(p) + len(a)] = 1
        batch[side], batch[f"{side}_mask"] = ids, mask
    return batch


def cli_train_args(out, tokenizer_dir, name, train_type, data):
    """``astrai train`` arguments for a tiny model on the data prepared under ``out`` (2 steps)."""
    return ["train", "--train_type", train_type, "--data_root_path", str(out / data), "--model_preset", "tiny",
            "--model_overrides", json.dumps(CLI_MODEL), "--tokenizer_path", str(tokenizer_dir), "--window_size", "64",
            "--batch_per_device", "4", "--max_steps", "2", "--max_lr", "1e-3", "--ckpt_dir", str(out / name),
            "--no-progress_bar"]


def run_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
