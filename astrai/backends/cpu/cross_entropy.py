"""The fused loss's softmax and logit gradient on the CPU in one kernel (native/cross_entropy.c).

``softmax_gradient`` is what ``LinearCrossEntropy`` does to each chunk of transposed logits
after its matmul - the columns' max, log-sum-exp, loss, and (softmax − target distribution)
times each token's weight written into the gradient rows - in three passes of one C call
instead of about eight PyTorch ops over the whole chunk. It reads bf16 logits as they come
out of the bf16 matmul (no widened copy) and writes a bf16 or fp32 gradient. The CPU backend
installs it for training runs (``HeadMatmuls.softmax_gradient``).
"""

from __future__ import annotations

from typing import Optional

import torch

from astrai.backends.cpu import kernels

_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _rows_of(t: torch.Tensor) -> int:
    """Elements between two vocabulary rows of a [vocab, rows] tensor whose rows are contiguous."""
    if t.dim() != 2 or t.stride(1) != 1 or t.dtype not in _KINDS or t.device.type != "cpu":
        raise ValueError(f"softmax_gradient: expected a CPU fp32 or bf16 [vocab, rows] tensor with contiguous rows, "
                         f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    return t.stride(0)


def softmax_gradient(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, smoothing: float,
                     grad: Optional[torch.Tensor]) -> torch.Tensor:
    """Per column of ``logits`` [vocab, rows]: its loss (fp32 [rows], unweighted) and, into
    ``grad`` (same shape, may be ``logits`` itself when fp32, or None), ``scale`` × (softmax −
    the target distribution with ``smoothing``). ``targets`` int64 [rows] in [0, vocab),
    ``scale`` fp32 [rows]."""
    vocab, rows = logits.shape
    ld = _rows_of(logits)
    grad_ld = 0
    if grad is not None:
        grad_ld = _rows_of(grad)
        if grad.shape != logits.shape:
            raise ValueError(f"softmax_gradient: grad {tuple(grad.shape)} does not match logits {tuple(logits.shape)}")
        if grad.data_ptr() == logits.data_ptr() and (grad.dtype != logits.dtype or grad_ld != ld):
            raise ValueError("softmax_gradient: in place only with the logits' own dtype and layout")
    targets = targets.reshape(-1).to(torch.int64).contiguous()
    scale = scale.reshape(-1).to(torch.float32).contiguous()
    if targets.numel() != rows or scale.numel() != rows:
        raise ValueError(f"softmax_gradient: {rows} columns but {targets.numel()} targets and {scale.numel()} scales")
    loss = torch.empty(rows, dtype=torch.float32)
    if rows:
        kernels._library().astrai_softmax_gradient(
            logits.data_ptr(), _KINDS[logits.dtype], ld, vocab, rows, targets.data_ptr(), scale.data_ptr(),
            float(smoothing), loss.data_ptr(), 0 if grad is None else grad.data_ptr(),
            0 if grad is None else _KINDS[grad.dtype], grad_ld, max(torch.get_num_threads(), 1))
    return loss
