"""Tiny models, in-memory datasets and configs shared by the trainer tests."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from astrai.config import TrainConfig, preset
from astrai.model import AutoModel
from astrai.trainer import TrainCallback

VOCAB = 64

# tiny_model(**MOE): many small experts, two active per token. With few tokens per rank most
# steps leave some expert idle on one rank and busy on another. No auxiliary loss: it is a
# product of two batch means, so the mean of per-rank losses differs from the doubled
# batch's by design.
MOE = dict(ffn_type="moe", n_routed_experts=32, n_shared_experts=1, n_activated_experts=2, moe_dim_ffn=8,
           n_dense_layers=0, aux_loss_coef=0.0)


def tiny_model(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = preset("tiny", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, dim_ffn=64, max_len=64,
                 **overrides)
    return AutoModel.from_config(cfg)


class TokenWindows(Dataset):
    """SEQ-style samples over a fixed random token stream (optionally with SFT loss masks)."""

    def __init__(self, n: int = 32, window: int = 16, seed: int = 0, sft: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, window + 1), generator=gen)
        self.masks = (torch.rand(n, window, generator=gen) > 0.5).long() if sft else None

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": self.tokens[i, :-1], "target_ids": self.tokens[i, 1:]}
        if self.masks is not None:
            item["loss_mask"] = self.masks[i]
        return item


def config(tmp_path, **overrides) -> TrainConfig:
    base = dict(train_type="seq", batch_per_device=2, grad_accum_steps=1, window_size=16, max_lr=1e-2,
                warmup_ratio=0.0, ckpt_dir=str(tmp_path / "ckpt"), ckpt_interval=1000, progress_bar=False,
                random_seed=1, adamw_weight_decay=0.01)
    base.update(overrides)
    return TrainConfig(**base)


class WeightSums(TrainCallback):
    """Writes each rank's per-parameter weight sums after every step to ``<out>/r<rank>_s<step>.json``
    (defined here, importable, so spawned processes can unpickle it)."""

    def __init__(self, out):
        self.out = out

    def on_step_end(self, context) -> None:
        import json

        from astrai.parallel.wrap import unwrap_model

        sums = {n: float(p.detach().double().sum()) for n, p in unwrap_model(context.model).named_parameters()}
        (self.out / f"r{context.rank}_s{context.step}.json").write_text(json.dumps(sums))


class MatmulsByRank(TrainCallback):
    """Makes each rank's own measurement of the fp32 matmuls disagree (oneDNN pays on rank 0
    only) and writes, per rank, the classes its head ran as to ``<out>/r<rank>.json``
    (importable, so spawned processes can unpickle it)."""

    def __init__(self, out):
        self.out, self.heads = out, set()

    def on_train_begin(self, context) -> None:
        from astrai.backends.cpu import training

        pays = context.rank == 0
        training._forward_layout_pays = training._weight_grad_layout_pays = lambda: pays

    def on_batch_begin(self, context) -> None:
        from astrai.parallel.wrap import unwrap_model

        self.heads.add(type(unwrap_model(context.model).lm_head).__name__)

    def on_train_end(self, context) -> None:
        import json

        (self.out / f"r{context.rank}.json").write_text(json.dumps(sorted(self.heads)))
