"""native/cross_entropy.c against the fused loss's own PyTorch ops (``chunk_softmax_gradient``),
at every kernel level this CPU runs, and the fused loss with the kernel installed against
plain cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.backends.cpu import kernels
from astrai.backends.cpu.cross_entropy import softmax_gradient
from astrai.backends.cpu.training import fast_training_matmuls
from astrai.model.components import linear_cross_entropy as lce

pytestmark = pytest.mark.skipif(not kernels.kernels_available(), reason="needs a C compiler (CI has one)")

LEVELS = [level.name for level in kernels.runnable_levels()]


def torch_ops(logits32, targets, scale, smoothing, grad_dtype):
    """The chunk's loss per column and its gradient by the fused loss's PyTorch path."""
    total = torch.zeros(())
    columns = []
    for c in range(logits32.shape[1]):  # one column at a time gives each column's own loss
        before = total.clone()
        lce.chunk_softmax_gradient(logits32[:, c:c + 1].clone(), targets[None, c:c + 1], torch.ones(1, 1), smoothing,
                                   None, 0, False, total)
        columns.append(total - before)
    grad = torch.empty(logits32.shape, dtype=grad_dtype)
    lce.chunk_softmax_gradient(logits32.clone(), targets[None], scale[None], smoothing, grad, 0, True, torch.zeros(()))
    return torch.stack(columns), grad


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("logit_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("columns", [1, 37, 64])  # a partial block of 32, whole blocks
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_kernel_gives_the_torch_ops_loss_and_gradient(monkeypatch, level, logit_dtype, grad_dtype, columns, smoothing):
    monkeypatch.setattr(kernels, "_library", lambda: kernels.level_library(level))
    torch.manual_seed(columns)
    vocab = 301
    logits = (torch.randn(vocab, columns + 5) * 4).to(logit_dtype)[:, 3:3 + columns]  # rows `ld` apart, not `columns`
    targets = torch.randint(0, vocab, (columns,))
    scale = torch.rand(columns) + 0.1
    scale[:columns - 1:2] = 0.0  # ignored tokens: no gradient (the last column always counts)
    want_loss, want_grad = torch_ops(logits.float(), targets, scale, smoothing, grad_dtype)
    grad = torch.full((vocab, columns + 7), float("nan"), dtype=grad_dtype)[:, 2:2 + columns]
    loss = softmax_gradient(logits, targets, scale, smoothing, grad)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    if grad_dtype == torch.float32:
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)
    else:  # the same fp32 value up to the last bits, rounded to bf16: at most one bf16 step apart
        torch.testing.assert_close(grad.float(), want_grad.float(), rtol=2 ** -7, atol=1e-9)
    assert torch.all(grad[:, scale == 0] == 0)
    assert grad[targets[-1], -1] < 0 and torch.all(grad[:, -1].float().sum().abs() < 1e-2)  # the target's -1
    assert torch.equal(softmax_gradient(logits, targets, scale, smoothing, None), loss)  # the loss alone


def test_fp32_logits_may_take_their_own_gradient_in_place():
    torch.manual_seed(0)
    logits = torch.randn(50, 40) * 3
    targets, scale = torch.randint(0, 50, (40,)), torch.rand(40)
    want_loss, want_grad = torch_ops(logits, targets, scale, 0.0, torch.float32)
    loss = softmax_gradient(logits, targets, scale, 0.0, logits)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_grad, rtol=1e-5, atol=1e-8)


def test_bad_layouts_are_refused_by_name():
    logits = torch.randn(10, 4)
    with pytest.raises(ValueError, match="contiguous rows"):
        softmax_gradient(logits.t(), torch.zeros(10, dtype=torch.long), torch.ones(10), 0.0, None)
    with pytest.raises(ValueError, match="4 columns but 3 targets"):
        softmax_gradient(logits, torch.zeros(3, dtype=torch.long), torch.ones(4), 0.0, None)
    with pytest.raises(ValueError, match="in place only"):
        softmax_gradient(logits, torch.zeros(4, dtype=torch.long), torch.ones(4), 0.0,
                         logits.view(torch.bfloat16)[:, :4])


@pytest.mark.parametrize("autocast", [False, True])
def test_the_fused_loss_with_the_kernel_installed_matches_cross_entropy(monkeypatch, autocast):
    """The CPU backend installs the kernel for training runs; the loss and both gradients stay
    those of plain cross-entropy (within bf16's rounding under autocast), ignored tokens too."""
    monkeypatch.setattr(lce, "CHUNK_ROWS", 16)
    monkeypatch.setattr(lce, "GRADIENT_ROWS_BYTES", 50 * 2 * 32)
    torch.manual_seed(0)
    hidden = torch.randn(75, 32, requires_grad=True)
    weight = (torch.randn(50, 32) * 0.3).requires_grad_()
    targets = torch.randint(0, 50, (75,))
    targets[:7] = -100
    want = F.cross_entropy((hidden @ weight.t()).float(), targets)
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    calls = []
    kernel = lambda *args: calls.append(args[0].dtype) or softmax_gradient(*args)  # noqa: E731
    monkeypatch.setattr("astrai.backends.cpu.training.softmax_gradient", kernel)
    monkeypatch.setattr("astrai.backends.cpu.training.cpu_bf16_matmul_pays", lambda: True)
    with fast_training_matmuls(torch.nn.Linear(2, 2), {"forward": False, "weight_grad": False}), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = lce.linear_cross_entropy(hidden, weight, targets)
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    assert calls == [torch.bfloat16 if autocast else torch.float32] * 5  # 16 + 16 + 16 + 16 + 11 rows
    tolerance = dict(rtol=0.1, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-7)
    assert got.item() == pytest.approx(want.item(), rel=2e-2 if autocast else 1e-6)
    torch.testing.assert_close(got_h, want_h, **tolerance)
    torch.testing.assert_close(got_w, want_w, **tolerance)
    assert torch.all(got_h[:7] == 0)
