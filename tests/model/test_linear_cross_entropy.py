"""The fused, chunked vocabulary projection + cross-entropy equals the plain one, value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.config import preset
from astrai.model import AutoModel
from astrai.model.components import linear_cross_entropy as lce
from astrai.trainer.strategies import StrategyFactory


def reference(hidden, weight, targets, smoothing=0.0):
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=-100, label_smoothing=smoothing)


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_value_and_gradients_match_plain_cross_entropy(monkeypatch, smoothing, given):
    """fp32 with either matmul: torch.mm's written in place per chunk, or a given ``matmul``
    (a training head's) with the weight gradient taken per group of chunks (here 2 chunks:
    32 + 32 + 11 rows)."""
    monkeypatch.setattr(lce, "CHUNK_ROWS", 16)  # 3 x 25 rows: several chunks, the last one partial
    monkeypatch.setattr(lce, "GRADIENT_ROWS_BYTES", 50 * 4 * 32)
    calls = []
    matmul = (lambda a, b: calls.append(a.shape) or a @ b.t()) if given else None
    torch.manual_seed(0)
    hidden = torch.randn(3, 25, 32, requires_grad=True)
    weight = (torch.randn(50, 32) * 0.3).requires_grad_()
    targets = torch.randint(0, 50, (3, 25))
    targets[0, :7] = -100  # ignored tokens: no loss, no gradient
    want = reference(hidden, weight, targets, smoothing)
    want_h, want_w = torch.autograd.grad(want * 3.0, (hidden, weight))
    got = lce.linear_cross_entropy(hidden, weight, targets, label_smoothing=smoothing, matmul=matmul)
    got_h, got_w = torch.autograd.grad(got * 3.0, (hidden, weight))
    assert len(calls) == (5 + 3 if given else 0)  # 5 chunks' logits, 3 groups' weight gradients
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)
    assert torch.all(got_h[0, :7] == 0)
    with torch.no_grad():  # evaluation: the value alone
        assert lce.linear_cross_entropy(hidden, weight, targets, label_smoothing=smoothing).item() == pytest.approx(want.item(), rel=1e-6)


def test_rows_whose_target_does_not_count_skip_the_projection():
    """SFT's loss mask leaves most prompt rows out: their logits are never computed."""
    logit_rows = []
    weight = (torch.randn(50, 32) * 0.3).requires_grad_()

    def matmul(a, b):
        if a is weight:  # W @ hᵀ: the logits of b's rows (the weight gradient is G @ h)
            logit_rows.append(b.shape[0])
        return a @ b.t()

    hidden = torch.randn(4, 30, 32, requires_grad=True)
    targets = torch.randint(0, 50, (4, 30))
    targets[:, :24] = -100  # a prompt of 24 tokens a row, 6 answer tokens counted
    got = lce.linear_cross_entropy(hidden, weight, targets, matmul=matmul)
    assert sum(logit_rows) == 24
    want = reference(hidden, weight, targets)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)
    assert torch.all(got_h[:, :24] == 0)


def test_all_ignored_gives_nan_like_cross_entropy():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    targets = torch.full((4,), -100)
    assert torch.isnan(reference(hidden, weight, targets)) and torch.isnan(lce.linear_cross_entropy(hidden, weight, targets))


def test_the_projection_follows_autocast_unless_the_installed_matmuls_say_it_does_not_pay():
    asked = []
    no_bf16 = lce.HeadMatmuls(low_precision_pays=lambda device, dtype: asked.append((device, dtype)) or False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lce.projection_dtype("cpu", torch.float32) == torch.bfloat16
        with lce.head_matmuls(no_bf16):
            assert lce.projection_dtype("cpu", torch.float32) == torch.float32
        assert lce.projection_dtype("cpu", torch.float32) == torch.bfloat16  # given back on leaving
    with lce.head_matmuls(no_bf16):
        assert lce.projection_dtype("cpu", torch.float32) == torch.float32  # no autocast: not asked
    assert asked == [("cpu", torch.bfloat16)]


def test_an_installed_matmul_takes_the_fp32_matmuls():
    calls = []
    matmuls = lce.HeadMatmuls(matmul=lambda a, b: calls.append(a.shape) or a @ b.t())
    hidden, weight = torch.randn(12, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 10, (12,))
    with lce.head_matmuls(matmuls):
        got = lce.linear_cross_entropy(hidden, weight, targets)
    assert calls and got.item() == pytest.approx(reference(hidden, weight, targets).item(), rel=1e-6)
    calls.clear()
    lce.linear_cross_entropy(hidden, weight, targets)
    assert calls == []


@pytest.mark.parametrize("bf16_pays", [False, True])
def test_bf16_autocast_stays_close_to_fp32(monkeypatch, bf16_pays):
    """Where bf16 matmuls are no faster the projection stays fp32 under CPU bf16 autocast
    (then it is exact); where they are, it runs in bf16 like any autocast linear, its
    weight gradient one matmul per group of chunks (here 24 + 24 + 16 rows)."""
    monkeypatch.setattr(lce, "_installed", lce.HeadMatmuls(low_precision_pays=lambda device, dtype: bf16_pays))
    monkeypatch.setattr(lce, "CHUNK_ROWS", 8)
    monkeypatch.setattr(lce, "GRADIENT_ROWS_BYTES", 40 * 2 * 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lce.projection_dtype("cpu", torch.float32) == (torch.bfloat16 if bf16_pays else torch.float32)
    assert lce.projection_dtype("cpu", torch.float32) == torch.float32
    torch.manual_seed(1)
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = (torch.randn(40, 32) * 0.3).requires_grad_()
    targets = torch.randint(0, 40, (64,))
    want = reference(hidden, weight, targets)
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lce.linear_cross_entropy(hidden, weight, targets)
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    assert got.dtype == torch.float32 and got_w.dtype == torch.float32
    tolerance = dict(rtol=0.1, atol=2e-3) if bf16_pays else dict(rtol=1e-5, atol=1e-7)
    assert got.item() == pytest.approx(want.item(), rel=2e-2 if bf16_pays else 1e-6)
    torch.testing.assert_close(got_h, want_h, **tolerance)
    torch.testing.assert_close(got_w, want_w, **tolerance)
    if bf16_pays:  # and as close to autocast's own bf16 logits as bf16 rounding allows
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = F.cross_entropy((hidden @ weight.t()).float(), targets)
        plain_h, plain_w = torch.autograd.grad(plain, (hidden, weight))
        torch.testing.assert_close(got_h, plain_h, rtol=2e-2, atol=2e-4)
        torch.testing.assert_close(got_w, plain_w, rtol=2e-2, atol=2e-4)


@pytest.mark.parametrize("train_type", ["seq", "sft"])
def test_strategy_loss_through_the_model_matches_logits(train_type):
    """SEQ/SFT ask the Transformer for the fused loss; it must equal the loss of its logits,
    gradients included (the tied embedding gets both of its gradient paths)."""
    torch.manual_seed(2)
    model = AutoModel.from_config(preset("tiny", vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, dim_ffn=64))
    ids = torch.randint(0, 300, (2, 12))
    batch = {"input_ids": ids, "target_ids": torch.randint(0, 300, (2, 12)),
             "loss_mask": torch.tensor([[0] * 5 + [1] * 7, [1] * 6 + [0] * 6])}
    strategy = StrategyFactory.create(model, train_type, "cpu", label_smoothing=0.05)
    fused = strategy(batch)
    fused_grads = torch.autograd.grad(fused, list(model.parameters()))
    targets = strategy.targets(batch)
    plain = F.cross_entropy(model(ids)["logits"].flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=0.05)
    plain_grads = torch.autograd.grad(plain, list(model.parameters()))
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5)
    for a, b in zip(fused_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
