"""Shared helpers of the inference and CPU-backend tests: tiny models, greedy decoding by full recomputation, weights and thread counts for the kernels."""

from __future__ import annotations

import torch

from astrai.config import preset
from astrai.model import AutoModel

SMALL = dict(vocab_size=256, n_layers=2, dim=64, dim_ffn=128, max_len=256)
OVERRIDES = {
    "tiny": dict(SMALL),
    "tiny-mla": dict(SMALL, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
    "tiny-moe": dict(SMALL, moe_dim_ffn=64, n_routed_experts=4, n_activated_experts=2),
}


def make_model(kind: str = "tiny", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    # A larger init spreads the logits so greedy choices are not near-ties.
    cfg = preset(kind, **{**OVERRIDES[kind], "init_std": 0.08, **overrides})
    return AutoModel.from_config(cfg).eval()


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation computed the plain way: the whole sequence re-run every step."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))["logits"][0, -1].argmax()))
    return ids[len(prompt):]


def with_uneven_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every norm weight drawn from [0.5, 1.5): at their initial ones, a norm
    weight read from the wrong layer would change nothing."""
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5)
    return model


def padded_weight(n_out: int, n_in: int, spare: int = 0) -> torch.Tensor:
    """[out, in] weight whose rows lie ``in + spare`` floats apart; the spare floats (and one
    more row after the last) hold NaN, so a matmul that reads past a row's inputs or past
    the outputs shows it."""
    storage = torch.randn(n_out + 1, n_in + spare)
    storage[:, n_in:] = float("nan")
    storage[n_out:] = float("nan")
    return storage[:n_out, :n_in]


def with_threads(threads: int, fn):
    """``fn()`` run with torch's thread count set to ``threads``, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)
