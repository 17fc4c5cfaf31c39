"""fp32 training products through oneDNN on CPU, where this CPU runs them faster than MKL.

PyTorch sends an fp32 ``F.linear`` on CPU, and both products of its backward, to the
MKL BLAS. On the AMD EPYC machine this project is measured on, MKL runs them at about
190-205 GFLOP/s (2 threads, 1,024 rows of the ``tiny`` and ``small`` layers' shapes)
while oneDNN's matmul, which PyTorch ships beside it and uses for bf16, runs the forward
product and the input's gradient at 205-230 - the same arithmetic in fp32, only a
different kernel (MKL keeps its AVX-512 code for Intel CPUs). The weight's gradient
``grad_outᵀ @ x`` reads both operands transposed, which oneDNN ran no faster (95-185
against 170-205), so it stays with MKL.

Whether oneDNN pays is asked of the CPU once per process (``onednn_fp32_pays``); on a
CPU where it does not, or without oneDNN, training takes ``F.linear`` as before.
``ASTRAI_ONEDNN_LINEAR=0`` or ``=1`` decides it without the measurement. The results
differ from MKL's by rounding only (the kernels add the same products in another order).
Autocast (bf16 on a CPU already goes to oneDNN), other devices and dtypes, tensor
subclasses and ``torch.compile`` keep the plain product.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Optional

import torch
from torch.autograd.function import once_differentiable


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by oneDNN's fp32 matmul; either operand may be a
    transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDnnLinear(torch.autograd.Function):
    """``F.linear`` whose forward product and input gradient run on oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        rows = x.reshape(-1, x.shape[-1])
        out = onednn_product(rows, weight, bias)
        ctx.save_for_backward(rows if ctx.needs_input_grad[1] else None, weight)
        ctx.input_shape = x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        rows, weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_product(grad, weight.t()).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t() @ rows  # MKL: oneDNN was no faster with both operands transposed
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def use_onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether this fp32 CPU product, with autograd on, should take ``OneDnnLinear``."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and (bias is None or (bias.dtype == torch.float32 and type(bias) in (torch.Tensor, torch.nn.Parameter)))
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and onednn_fp32_pays())


@functools.cache
def onednn_fp32_pays() -> bool:
    """True when oneDNN's fp32 matmul is here and clearly (5%) faster than MKL's on a
    training-sized product (``product_seconds``); ``ASTRAI_ONEDNN_LINEAR`` overrides."""
    forced = os.environ.get("ASTRAI_ONEDNN_LINEAR")
    available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if not available or forced == "0":
        return False
    if forced == "1":
        return True
    try:
        mkl, onednn = product_seconds()
    except RuntimeError:  # a build whose oneDNN refuses the product
        return False
    return onednn * 1.05 < mkl


def product_seconds(repeats: int = 7) -> tuple[float, float]:
    """(MKL, oneDNN) seconds for 512 rows of width 512 into 1,536 outputs: best of
    ``repeats`` each, alternating, after a warm-up; some 60 ms once per process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=generator)
    weight = torch.randn(1536, 512, generator=generator)
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        onednn_product(x, weight)
        torch.mm(x, weight.t())
        mkl = onednn = float("inf")
        for _ in range(repeats):
            mkl = min(mkl, _seconds(lambda: torch.mm(x, weight.t())))
            onednn = min(onednn, _seconds(lambda: onednn_product(x, weight)))
    return mkl, onednn


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
