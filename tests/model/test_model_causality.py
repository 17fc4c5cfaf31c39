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


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_index_gives_the_full_forwards_logits_at_those_positions(kind):
    """Out of training the last block runs its output projection and feed-forward on the
    picked positions only; the logits must be those of the full forward there."""
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **KINDS[kind])).eval()
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        full = model(ids)["logits"]
        one = model(ids, logits_index=torch.tensor([5, 2]))["logits"]
        several = model(ids, logits_index=torch.tensor([[0, 5, 3], [2, 2, 4]]))["logits"]
    assert one.shape == (2, 1, 128) and several.shape == (2, 3, 128)
    torch.testing.assert_close(one[:, 0], full[[0, 1], [5, 2]], rtol=0, atol=1e-5)
    torch.testing.assert_close(several, full[[[0], [1]], [[0, 5, 3], [2, 2, 4]]], rtol=0, atol=1e-5)


def _rows_into_last_feed_forward(model, **kwargs) -> tuple[int, ...]:
    seen = []
    handle = model.layers[-1].mlp.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    try:
        model(torch.randint(0, 128, (2, 6)), **kwargs)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("kind", ["gqa-qknorm-gated", "mla"])
def test_only_the_picked_positions_reach_the_last_feed_forward_out_of_training(kind):
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **KINDS[kind])).eval()
    with torch.no_grad():
        assert _rows_into_last_feed_forward(model, logits_index=torch.tensor([5, 2])) == (2, 1, 64)
        assert _rows_into_last_feed_forward(model, logits_index=torch.tensor([[1, 4], [0, 3]])) == (2, 2, 64)
        assert _rows_into_last_feed_forward(model) == (2, 6, 64)


def test_training_keeps_every_position_for_the_moe_balancing_loss():
    """In training an MoE block's load-balancing loss counts every position: picking
    positions must not change it, so the last block still runs on all of them."""
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **KINDS["moe"])).train()
    ids = torch.randint(0, 128, (2, 6))
    assert _rows_into_last_feed_forward(model, logits_index=torch.tensor([5, 2])) == (2, 6, 64)
    full = model(ids)["aux_loss"]
    picked = model(ids, logits_index=torch.tensor([5, 2]))
    torch.testing.assert_close(picked["aux_loss"], full)
    assert picked["logits"].shape == (2, 1, 128)
