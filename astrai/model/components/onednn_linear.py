"""fp32 training products through oneDNN on CPU, where this CPU runs them faster than MKL.

PyTorch sends an fp32 ``F.linear`` on CPU, and both products of its backward, to the
MKL BLAS, which keeps its AVX-512 code for Intel CPUs. oneDNN's matmul, which PyTorch
ships beside it and uses for bf16, does the same fp32 arithmetic with its own kernels,
and how much faster that is depends on the CPU (2 threads, 1,024 rows of the ``tiny``
and ``small`` layers' shapes):

- on the AMD EPYC VM of the nineteenth session, where this was first measured, MKL ran at
  190-205 GFLOP/s, oneDNN at 205-230 for the forward product and the input's
  gradient, and no faster for the weight's gradient ``grad_outᵀ @ x``, whose operands
  both lie transposed;
- on the faster AMD EPYC VM of the twentieth session (AVX-512 with bf16 in its flags),
  MKL runs at 200-230 and oneDNN at 455-525 for the forward and input-gradient
  products and at 320-445 for the weight's gradient.

So each of the two layouts is asked of the CPU once per process: ``onednn_fp32_pays``
(``x @ Wᵀ``: the forward product and the input's gradient) and ``onednn_weight_grad_pays``
(both operands transposed: the weight's gradient). Where oneDNN does not pay, or is
missing, training takes ``F.linear``'s products as before. ``ASTRAI_ONEDNN_LINEAR=0`` or
``=1`` decides both without the measurement. The results differ from MKL's by rounding
only (the kernels add the same products in another order). Autocast (bf16 on a CPU
already goes to oneDNN), other devices and dtypes and tensor subclasses keep the plain
product. Inside ``torch.compile`` the product is a custom op the compiler leaves as it
is (``astrai::onednn_product``), and the two answers are constants, so a compiled fp32
step keeps oneDNN's products (before, it fell back to MKL's and ran 40% slower).
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
    transposed view. Inside ``torch.compile`` it is the opaque ``astrai::onednn_product``."""
    if torch.compiler.is_compiling():
        return _compiled_product(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@torch.library.custom_op("astrai::onednn_product", mutates_args=())
def _compiled_product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_compiled_product.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


class OneDnnLinear(torch.autograd.Function):
    """``F.linear`` whose forward product and input gradient run on oneDNN, and its
    weight gradient too where that layout pays as well."""

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
            # oneDNN refuses a product over no rows (an expert no token chose); MKL gives zeros
            transposed = onednn_weight_grad_pays() and grad.shape[0] > 0
            grad_weight = onednn_product(grad.t(), rows.t()) if transposed else grad.t() @ rows
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def use_onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether this fp32 CPU product, with autograd on, should take ``OneDnnLinear``."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and (bias is None or (bias.dtype == torch.float32 and type(bias) in (torch.Tensor, torch.nn.Parameter)))
            and not torch.is_autocast_enabled("cpu")
            and onednn_fp32_pays())


@torch.compiler.assume_constant_result
def onednn_fp32_pays() -> bool:
    """True when oneDNN's fp32 matmul is here and clearly (5%) faster than MKL's on a
    training-sized ``x @ Wᵀ`` (``product_seconds``); ``ASTRAI_ONEDNN_LINEAR`` overrides."""
    return _forward_layout_pays()


@torch.compiler.assume_constant_result
def onednn_weight_grad_pays() -> bool:
    """The same question for a weight gradient's layout, ``gradᵀ @ x`` with both operands
    transposed; asked only where the first answer is yes."""
    return _weight_grad_layout_pays()


@functools.cache
def _forward_layout_pays() -> bool:
    return _measured_pays(transposed=False)


@functools.cache
def _weight_grad_layout_pays() -> bool:
    return onednn_fp32_pays() and _measured_pays(transposed=True)


def _measured_pays(transposed: bool) -> bool:
    forced = os.environ.get("ASTRAI_ONEDNN_LINEAR")
    available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if not available or forced == "0":
        return False
    if forced == "1":
        return True
    try:
        mkl, onednn = product_seconds(transposed=transposed)
    except RuntimeError:  # a build whose oneDNN refuses the product
        return False
    return onednn * 1.05 < mkl


def product_seconds(repeats: int = 7, transposed: bool = False) -> tuple[float, float]:
    """(MKL, oneDNN) seconds for 512 rows of width 512 into 1,536 outputs (``x @ Wᵀ``),
    or, ``transposed``, for that layer's weight gradient ``gradᵀ @ x``: best of
    ``repeats`` each, alternating, after a warm-up; some 60 ms once per process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=generator)
    if transposed:
        grad = torch.randn(512, 1536, generator=generator)
        with_mkl, with_onednn = (lambda: torch.mm(grad.t(), x)), (lambda: onednn_product(grad.t(), x.t()))
    else:
        weight = torch.randn(1536, 512, generator=generator)
        with_mkl, with_onednn = (lambda: torch.mm(x, weight.t())), (lambda: onednn_product(x, weight))
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        with_onednn()
        with_mkl()
        mkl = onednn = float("inf")
        for _ in range(repeats):
            mkl = min(mkl, _seconds(with_mkl))
            onednn = min(onednn, _seconds(with_onednn))
    return mkl, onednn


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
