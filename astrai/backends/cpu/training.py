"""fp32 training products through oneDNN on the CPU, for the trainer to opt into.

PyTorch sends an fp32 ``F.linear`` on CPU, and both products of its backward, to the
MKL BLAS, which keeps its fastest code for Intel CPUs. oneDNN's matmul, which PyTorch
ships beside it and uses for bf16, does the same fp32 arithmetic with its own kernels;
how much faster that is depends on the CPU, and may differ between the forward layout
(``x @ Wᵀ``, also the input's gradient) and the weight gradient's (both operands
transposed). So each layout is asked of the CPU once per process (``onednn_fp32_pays``,
``onednn_weight_grad_pays``), and ``ASTRAI_ONEDNN_LINEAR=0`` or ``=1`` decides both without
the measurement. The results differ from MKL's by rounding only.

The trainer opts in with ``fast_training_products(model)``: for the duration of a run the
model's plain linears become ``OneDnnLinear`` (same parameters, nothing copied), and the
model is given back with its own classes afterwards. Autocast (bf16 on a CPU already goes
to oneDNN), other devices and dtypes and tensor subclasses keep the plain product. Inside
``torch.compile`` the product is a custom op the compiler leaves as it is
(``astrai::onednn_product``), and the two answers are constants, so a compiled fp32 step
keeps oneDNN's products.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from astrai.model.components.layers import Linear


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


class OneDnnProduct(torch.autograd.Function):
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


class OneDnnLinear(Linear):
    """A linear whose fp32 CPU products with autograd take ``OneDnnProduct``; as the model's
    head it also lends oneDNN's product to the fused cross-entropy (``product``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return training_linear(x, self.weight, self.bias)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ bᵀ`` (linear_cross_entropy's ``product``): through oneDNN where it applies."""
        fits = _plain_fp32(a) and _plain_fp32(b) and not torch.is_autocast_enabled("cpu") and onednn_fp32_pays()
        return onednn_product(a, b) if fits else a @ b.t()


def training_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``, through ``OneDnnProduct`` for an fp32 CPU product with autograd on where that pays."""
    if torch.is_grad_enabled() and use_onednn(x, weight, bias):
        return OneDnnProduct.apply(x, weight, bias)
    return F.linear(x, weight, bias)


@contextlib.contextmanager
def fast_training_products(model: nn.Module) -> Iterator[int]:
    """Within the block, ``model``'s plain fp32 CPU linears run their products on oneDNN,
    where this CPU runs them faster (yields how many linears were switched; 0 elsewhere).
    Their parameters stay the same objects; the classes are restored on leaving."""
    swapped = []
    if any(type(m) in (Linear, nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
           for m in model.modules()) and onednn_fp32_pays():
        for module in model.modules():
            if type(module) in (Linear, nn.Linear):
                swapped.append((module, type(module)))
                module.__class__ = OneDnnLinear
    try:
        yield len(swapped)
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def use_onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether this fp32 CPU product should take ``OneDnnProduct``."""
    return (type(x) is torch.Tensor and _plain_fp32(weight) and (bias is None or _plain_fp32(bias))
            and _plain_fp32(x) and not torch.is_autocast_enabled("cpu") and onednn_fp32_pays())


def _plain_fp32(t: torch.Tensor) -> bool:
    """An fp32 CPU tensor or parameter, not a subclass (DTensor, a tensor parallel's shard)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter)


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
