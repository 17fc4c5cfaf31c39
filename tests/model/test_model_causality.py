"""Causality: a token never influences logits at earlier positions, for every attention/FFN kind."""

import pytest
import torch

from astrai.config import preset
from astrai.model import AutoModel

TINY = dict(vocab_size=128, dim=64, n_layers=2, dim_ffn=128, n_heads=4, n_kv_heads=2)
KINDS = {
    "gqa": dict(TINY),
    "gqa-qknorm-gated": dict(TINY, use_qk_norm=True, use_gated_attention=True),
    "mla": dict(TINY, attn_type="mla", kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "moe": dict(TINY, ffn_type="moe", n_routed_experts=4, n_shared_experts=1, n_activated_experts=2, moe_dim_ffn=32,
                n_dense_layers=1),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding-mask"])
def test_changing_token_t_never_changes_earlier_logits(kind, padded):
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **KINDS[kind])).eval()
    T, t = 12, 7
    ids = torch.randint(0, 128, (2, T))
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % 128
    mask = None
    if padded:
        mask = torch.ones(2, T, dtype=torch.long)
        mask[1, :3] = 0  # left padding in row 1
    with torch.no_grad():
        before = model(ids, input_mask=mask)["logits"]
        after = model(changed, input_mask=mask)["logits"]
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t:], after[:, t:])


def test_padding_mask_adds_to_causality_rather_than_replacing_it():
    """An all-ones padding mask must give exactly the plain causal result."""
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **TINY)).eval()
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        plain = model(ids)["logits"]
        masked = model(ids, input_mask=torch.ones(2, 10, dtype=torch.long))["logits"]
        doc = model(ids, input_mask=torch.ones(2, 10, 10, dtype=torch.bool))["logits"]
    torch.testing.assert_close(plain, masked, rtol=0, atol=1e-5)
    torch.testing.assert_close(plain, doc, rtol=0, atol=1e-5)


def test_left_padding_does_not_change_real_tokens_logits():
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **TINY)).eval()
    ids = torch.randint(0, 128, (1, 8))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], dim=1)
    positions = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.arange(8)[None]], dim=1)
    with torch.no_grad():
        alone = model(ids)["logits"]
        with_pad = model(padded, input_mask=mask, position_ids=positions)["logits"][:, 3:]
    torch.testing.assert_close(alone, with_pad, rtol=0, atol=1e-5)


def test_logits_index_selects_one_position_per_row():
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **TINY)).eval()
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        full = model(ids)["logits"]
        picked = model(ids, logits_index=torch.tensor([5, 2]))["logits"]
    assert picked.shape == (2, 1, 128)
    torch.testing.assert_close(picked[:, 0], full[[0, 1], [5, 2]], rtol=0, atol=1e-6)
