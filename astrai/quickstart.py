"""``astrai quickstart``: the first thing a newcomer runs.

For now it builds the tiny model, saves it, loads it back and greedily continues a
prompt of token ids; the full pipeline (tokenizer → pre-training → SFT → DPO → GRPO
→ report) grows here as those stages land.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/quickstart", help="output directory (default: runs/quickstart)")
    parser.add_argument("--minutes", type=float, default=15.0, help="time budget for the whole run")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch

    from astrai.config import preset
    from astrai.model import AutoModel

    torch.manual_seed(args.seed)
    out = Path(args.out) / "model"
    model = AutoModel.from_config(preset("tiny"))
    model.save_pretrained(out)
    loaded = AutoModel.from_pretrained(out).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(16):
            next_id = loaded(ids)["logits"][:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    print(f"model saved to {out} and loaded back: {loaded.num_parameters():,} parameters")
    print(f"greedy continuation of [1, 2, 3, 4]: {ids[0, 4:].tolist()} ({time.perf_counter() - start:.2f}s)")
    return 0
