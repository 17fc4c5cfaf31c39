"""fp32 training matmuls through oneDNN on the CPU, for the trainer to opt into.

PyTorch sends an fp32 ``F.linear`` on CPU, and both matmuls of its backward, to the
MKL BLAS, which keeps its fastest code for Intel CPUs. oneDNN's matmul, which PyTorch
ships beside it and uses for bf16, does the same fp32 arithmetic with its own kernels;
how much faster that is depends on the CPU, and may differ between the forward layout
(``x @ Wᵀ``, also the input's gradient) and the weight gradient's (both operands
transposed). So each layout is asked of the CPU once per process (``measured_choice``),
and ``ASTRAI_ONEDNN_LINEAR=0`` or ``=1`` decides both without the measurement. The results
differ from MKL's by rounding only, which is enough to make two runs differ: so a run decides
once (``agree_on_matmuls``) and every process of it keeps that decision. Under
torch.distributed every rank takes rank 0's; a resumed run takes the one its checkpoint
records (the environment variable still overrides both).

The trainer opts in with ``fast_training_matmuls(model, choice)``: for the duration of a run
the model's plain linears become ``OneDnnLinear`` (same parameters, nothing copied), and the
model is given back with its own classes afterwards. The block also installs the fused
loss's matmuls (``HeadMatmuls``, astrai/model/components/linear_cross_entropy.py): the
vocabulary projection's fp32 matmuls on oneDNN likewise, and, under bf16 autocast, the
projection in bf16 only where this CPU's bf16 matmul is clearly faster
(``cpu_bf16_matmul_pays``): some CPUs with bf16 instructions multiply bf16 matrices slower
than fp32 ones; and each chunk's softmax and logit gradient go to one C kernel
(cross_entropy.py) where the kernels are built. Autocast (bf16 on a CPU already goes
to oneDNN), other devices and dtypes and tensor subclasses keep the plain matmul. Inside
``torch.compile`` the matmul is a custom op the compiler leaves as it is
(``astrai::onednn_matmul``), and the two answers are constants, so a compiled fp32 step
keeps oneDNN's matmuls.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from astrai.backends.cpu.cross_entropy import softmax_gradient
from astrai.backends.cpu.kernels import kernels_available
from astrai.model.components.layers import Linear
from astrai.model.components.linear_cross_entropy import HeadMatmuls, head_matmuls


def onednn_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by oneDNN's fp32 matmul; either operand may be a
    transposed view. Inside ``torch.compile`` it is the opaque ``astrai::onednn_matmul``."""
    if torch.compiler.is_compiling():
        return _compiled_matmul(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@torch.library.custom_op("astrai::onednn_matmul", mutates_args=())
def _compiled_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_compiled_matmul.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


class OneDnnMatmul(torch.autograd.Function):
    """``F.linear`` whose forward matmul and input gradient run on oneDNN, and its
    weight gradient too where that layout pays as well."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        rows = x.reshape(-1, x.shape[-1])
        out = onednn_matmul(rows, weight, bias)
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
            grad_x = onednn_matmul(grad, weight.t()).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            # oneDNN refuses a matmul over no rows (an expert no token chose); MKL gives zeros
            transposed = onednn_weight_grad_pays() and grad.shape[0] > 0
            grad_weight = onednn_matmul(grad.t(), rows.t()) if transposed else grad.t() @ rows
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


class OneDnnLinear(Linear):
    """A linear whose fp32 CPU matmuls with autograd take ``OneDnnMatmul``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return training_linear(x, self.weight, self.bias)


def head_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ bᵀ`` for the fused loss's fp32 matmuls (``HeadMatmuls.matmul``): through oneDNN where it applies."""
    fits = _plain_fp32(a) and _plain_fp32(b) and not torch.is_autocast_enabled("cpu") and onednn_fp32_pays()
    return onednn_matmul(a, b) if fits else a @ b.t()


def low_precision_pays(device_type: str, dtype: torch.dtype) -> bool:
    """``HeadMatmuls.low_precision_pays``: a bf16 projection on this CPU only where it is faster."""
    return device_type != "cpu" or dtype != torch.bfloat16 or cpu_bf16_matmul_pays()


def training_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``, through ``OneDnnMatmul`` for an fp32 CPU matmul with autograd on where that pays."""
    if torch.is_grad_enabled() and use_onednn(x, weight, bias):
        return OneDnnMatmul.apply(x, weight, bias)
    return F.linear(x, weight, bias)


@contextlib.contextmanager
def fast_training_matmuls(model: nn.Module, choice: Optional[dict] = None) -> Iterator[int]:
    """Within the block, ``model``'s plain fp32 CPU linears run their matmuls on oneDNN
    where ``choice`` (``agree_on_matmuls``' answer; asked here when not given) says so, and
    every matmul follows that choice (yields how many linears were switched; 0 elsewhere);
    the fused loss's matmuls follow it too (``HeadMatmuls``). Their parameters stay the same
    objects; the classes are restored on leaving."""
    global _run_choice
    choice = choice if choice is not None else agree_on_matmuls(model)
    swapped = []
    forward = choice is not None and choice["forward"]
    if forward:
        for module in model.modules():
            if type(module) in (Linear, nn.Linear):
                swapped.append((module, type(module)))
                module.__class__ = OneDnnLinear
    outer, _run_choice = _run_choice, choice if choice is not None else _run_choice
    matmuls = HeadMatmuls(matmul=head_matmul if forward else None, low_precision_pays=low_precision_pays,
                          softmax_gradient=softmax_gradient if kernels_available() else None)
    try:
        with head_matmuls(matmuls):
            yield len(swapped)
    finally:
        _run_choice = outer
        for module, cls in swapped:
            module.__class__ = cls


_run_choice: Optional[dict] = None  # the decision of the run in progress, within fast_training_matmuls


def agree_on_matmuls(model: nn.Module, recorded: Any = None) -> Optional[dict]:
    """The run's decision ``{"forward": bool, "weight_grad": bool}`` for ``model``'s fp32 CPU
    matmuls, or None when it has none to decide. ``ASTRAI_ONEDNN_LINEAR`` decides if set;
    else ``recorded`` (a resumed run's checkpoint) if it is such a decision; else this CPU's
    ``measured_choice``. Under torch.distributed every rank takes rank 0's (a collective:
    call it on every rank), so the ranks' matmuls round alike."""
    if not any(type(m) in (Linear, nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
               for m in model.modules()):
        return None
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    choice = {"forward": False, "weight_grad": False}
    if not distributed or dist.get_rank() == 0:
        forced = os.environ.get("ASTRAI_ONEDNN_LINEAR")
        if forced in ("0", "1"):
            choice = {"forward": forced == "1", "weight_grad": forced == "1"}
        elif _is_choice(recorded):
            choice = {"forward": recorded["forward"], "weight_grad": recorded["forward"] and recorded["weight_grad"]}
        else:
            choice = measured_choice()
    if distributed:
        flags = torch.tensor([choice["forward"], choice["weight_grad"]], dtype=torch.int64)
        dist.broadcast(flags, src=0)
        choice = {"forward": bool(flags[0]), "weight_grad": bool(flags[1])}
    available = _onednn_available()
    return {name: value and available for name, value in choice.items()}


def measured_choice() -> dict:
    """This process's own answers (measured once, or ``ASTRAI_ONEDNN_LINEAR``'s)."""
    forward = onednn_fp32_pays()
    return {"forward": forward, "weight_grad": forward and onednn_weight_grad_pays()}


def _is_choice(recorded: Any) -> bool:
    return (isinstance(recorded, dict) and isinstance(recorded.get("forward"), bool)
            and isinstance(recorded.get("weight_grad"), bool))


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether this fp32 CPU matmul should take ``OneDnnMatmul``."""
    return (type(x) is torch.Tensor and _plain_fp32(weight) and (bias is None or _plain_fp32(bias))
            and _plain_fp32(x) and not torch.is_autocast_enabled("cpu") and onednn_fp32_pays())


def _plain_fp32(t: torch.Tensor) -> bool:
    """An fp32 CPU tensor or parameter, not a subclass (DTensor, a tensor parallel's shard)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter)


@torch.compiler.assume_constant_result
def onednn_fp32_pays() -> bool:
    """True when oneDNN's fp32 matmul is here and clearly (5%) faster than MKL's on a
    training-sized ``x @ Wᵀ`` (``matmul_seconds``); ``ASTRAI_ONEDNN_LINEAR`` overrides.
    Within a run, the run's decision."""
    return _run_choice["forward"] if _run_choice is not None else _forward_layout_pays()


@torch.compiler.assume_constant_result
def onednn_weight_grad_pays() -> bool:
    """The same question for a weight gradient's layout, ``gradᵀ @ x`` with both operands
    transposed; asked only where the first answer is yes."""
    return _run_choice["weight_grad"] if _run_choice is not None else _weight_grad_layout_pays()


@functools.cache
def _forward_layout_pays() -> bool:
    return _measured_pays(transposed=False)


@functools.cache
def _weight_grad_layout_pays() -> bool:
    return onednn_fp32_pays() and _measured_pays(transposed=True)


def _measured_pays(transposed: bool) -> bool:
    forced = os.environ.get("ASTRAI_ONEDNN_LINEAR")
    if not _onednn_available() or forced == "0":
        return False
    if forced == "1":
        return True
    try:
        mkl, onednn = matmul_seconds(transposed=transposed)
    except RuntimeError:  # a build whose oneDNN refuses the matmul
        return False
    return onednn * 1.05 < mkl


def matmul_seconds(repeats: int = 7, transposed: bool = False) -> tuple[float, float]:
    """(MKL, oneDNN) seconds for 512 rows of width 512 into 1,536 outputs (``x @ Wᵀ``),
    or, ``transposed``, for that layer's weight gradient ``gradᵀ @ x``: best of
    ``repeats`` each, alternating, after a warm-up; some 60 ms once per process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=generator)
    if transposed:
        grad = torch.randn(512, 1536, generator=generator)
        with_mkl, with_onednn = (lambda: torch.mm(grad.t(), x)), (lambda: onednn_matmul(grad.t(), x.t()))
    else:
        weight = torch.randn(1536, 512, generator=generator)
        with_mkl, with_onednn = (lambda: torch.mm(x, weight.t())), (lambda: onednn_matmul(x, weight))
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


@torch.compiler.assume_constant_result
def cpu_bf16_matmul_pays() -> bool:
    """True with AMX tiles, else when a bf16 matmul of 512² runs clearly (1.25x) faster than
    the fp32 one here: best of five each after a warm-up, some 20 ms once per process.
    Marked constant for ``torch.compile``, which then takes the answer as the eager model
    does instead of tracing the measurement."""
    return _bf16_matmul_measured()


@functools.cache
def _bf16_matmul_measured() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if check is not None and check():
        return True
    a = torch.randn(512, 512)
    b = torch.randn(512, 512)
    return _best_matmul_seconds(a.bfloat16(), b.bfloat16()) * 1.25 < _best_matmul_seconds(a, b)


def _best_matmul_seconds(a: torch.Tensor, b: torch.Tensor, repeats: int = 5) -> float:
    with torch.autocast("cpu", enabled=False):
        a @ b
        return min(_seconds(lambda: a @ b) for _ in range(repeats))
