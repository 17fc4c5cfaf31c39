"""How the CPU runner prepares its model for serving: weight layout and serving modules.

Without autograd, the matmuls of a decode step are few rows by large weights, which the
CPU runs faster through other kernels than the one ``F.linear`` picks (``serving_linear``):

- one row through the C GEMV (kernels.py), which gives each thread one
  contiguous stretch of the weight's rows to stream, and 2 to ``MAX_F32_ROWS`` rows (a
  decode batch) through its few-rows form, which streams the weight once for all of them;
- more rows from the weight's oneDNN-packed copy (made once, packed again only when the
  weight changed: an ``update_weights`` copies new values in place);
- otherwise, up to 64 rows, as one batched matmul over the weight's two halves of
  outputs, which keeps both threads of a small machine busy where the BLAS would not.

``prepare_for_serving`` arranges the runner's own copy of the model for them: the linears
that read the same input (a module's ``input_projections()``: q/k/v, gate/up) are stacked
in one buffer, every weight a view of its block of rows, and the module becomes its
serving subclass, whose ``project`` runs the group as one matmul over the joint weight -
one longer stream per thread, one call instead of three; large weights sit in huge-page
memory (huge_pages.py); every other plain linear becomes a ``ServingLinear``. Values,
parameter names and ties never change, so the model's state dict is the same.

Smaller weights take the weight-only dequantizing matmuls of native/dequant_matmul.c
(``dequant_serving_linear``): a ``QuantizedLinear`` (int8/int4 blocks,
astrai/model/quantized.py) becomes a ``ServingQuantizedLinear`` and a bf16 linear a
``ServingLinear``; up to ``DEQUANT_MAX_ROWS`` rows (a decode step, continuous batching's few
rows; ``MAX_DEQUANT_ROWS`` a pass) read the weight once in C, summing in fp32 (int8/int4: in
integers, over the activations rounded to Q8_0 blocks; bf16: over the activations rounded
to bf16). More rows (a prefill) of a bf16 weight take ``bf16_matmul`` on a CPU with
AVX512-BF16; otherwise dense_matmul.py widens a bf16 or int8 weight to fp32 in C, a slab at a
time into a buffer each thread keeps, for oneDNN's GEMM (in fp32, bf16 activations too, on a
CPU without native bf16 matmuls, where torch would emulate them; without the native library
torch multiplies the weight dequantized once for the call). ``integer_matmul`` multiplies by the
rounded activations in integers instead: an int4 weight from ``INTEGER_MIN_ROWS`` rows on
(the dequantizing matmul's one read of the weight wins for one to three rows only, as soon
as the sums, not the reads, are the bound), an int8 one past ``DEQUANT_MAX_ROWS`` rows on a
CPU with VNNI. Their groups stack too: stacking along the outputs concatenates rows, so the
joint weight of quantized members is their values and scales, each concatenated.

Q4_0 weights (int4 without minimums), and Q8_0 ones where ``integer_int8_available()``, are
then re-laid eight rows interleaved (interleaved.py, an ``InterleavedQuantizedLinear``): each
load then holds four inputs of eight rows, so the few-row kernel sums eight outputs per
instruction without horizontal sums or per-row work after it, reads at about the rate of a
bare read (docs/benchmarks.md), and a few rows cost little more than one; such a weight takes
the dequantizing matmul up to ``MAX_DEQUANT_ROWS`` rows, ``integer_matmul`` beyond.

Every matmul notes which kernel ran it in a per-thread tally (``kernel_counts``), which the
runner turns into its count of decode steps per path.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from astrai.backends.cpu.dense_matmul import (bf16_matmul, bf16_matmul_available, dense_matmul, dense_matmul_available,
                                              integer_int8_available, integer_matmul)
from astrai.backends.cpu.huge_pages import HUGE_PAGE_BYTES, huge_page_empty, huge_pages_available
from astrai.backends.cpu.interleaved import (can_interleave, interleaved_scales, interleaved_values, model_scales,
                                             model_values)
from astrai.backends.cpu.kernels import (BF16, F32, INTERLEAVED_KINDS, MAX_DEQUANT_ROWS, MAX_F32_ROWS, Q4, Q4X8, Q8,
                                         Q8X8, Q41, QUANTIZED_KINDS, TypedWeight, cpu_flags, dequant_matmul, kernels_available, rounded_activations,
                                         row_major, row_matmul, rows_matmul)
from astrai.backends.cpu.training import OneDnnLinear
from astrai.model.components.attention import GQA, MLA
from astrai.model.components.ffn import MLP
from astrai.model.components.layers import Linear
from astrai.model.quantized import QuantizedLinear, dequantize_weight
from astrai.model.weight_files import release_weight_file

SPLIT_MAX_ROWS = 64  # matmuls of at most this many rows are split in two (see serving_linear)
SERVED_DTYPES = (torch.float32, torch.bfloat16)
# rows a dequantizing matmul reads its weight for in passes of MAX_DEQUANT_ROWS: a decode batch's;
# beyond, dequantizing the weight once for torch's matmul costs less than more passes
DEQUANT_MAX_ROWS = 2 * MAX_DEQUANT_ROWS  # float weights the serving layout takes
# rows from which an int4 linear unpacks the weight for integer_matmul: below, the dequantizing
# matmul's one read of the weight is faster (at three rows it depends on the shape); from
# four rows on its sums are the bound. An interleaved one (Q4X8, and Q8X8 for int8), whose eight
# rows' sums come out of each instruction, takes the dequantizing matmul up to MAX_DEQUANT_ROWS rows.
INTEGER_MIN_ROWS = 4
# rows past which an int8 weight takes integer_matmul (with VNNI): interleaved, past one pass
# of the dequantizing matmul; in rows, past the passes a decode batch takes
INT8_INTEGER_ROWS = {Q8X8: MAX_DEQUANT_ROWS, Q8: DEQUANT_MAX_ROWS}
_tally = threading.local()


def kernel_counts() -> Counter:
    """This thread's count of matmuls by the kernel that ran them since it started: "kernel"
    (astrai's C kernels), "packed" (oneDNN's packed copy), "split" (two halves in one bmm),
    "dense" (a typed weight dequantized for torch's matmul) and "torch" (F.linear as it is)."""
    counts = getattr(_tally, "counts", None)
    if counts is None:
        counts = _tally.counts = Counter()
    return counts


def _note(kernel: str) -> None:
    kernel_counts()[kernel] += 1


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed fp32 linear (x86 builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedWeight:
    """A weight's oneDNN-packed copy, packed again before its next use when any of the weights
    it was made from changed (their version counters or the address moved)."""

    def __init__(self, weight: torch.Tensor, sources: Sequence[torch.Tensor]):
        self.weight, self.sources = weight, list(sources)
        self._stamp: Optional[tuple] = None
        self._packed: Optional[torch.Tensor] = None

    def get(self) -> Optional[torch.Tensor]:
        stamp = (self.weight.data_ptr(), *(w._version for w in self.sources))
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            except RuntimeError:  # a build whose oneDNN refuses this shape: the other kernels remain
                self._packed = None
        return self._packed


def serving_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   packed: Optional[PackedWeight]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the fastest kernel for an fp32 CPU matmul without
    autograd (see the module's docstring)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled():
        rows = x.numel() // max(x.shape[-1], 1)
        if (1 < rows <= MAX_F32_ROWS and weight.dtype == torch.float32 and x.is_contiguous() and row_major(weight)
                and (bias is None or bias.dtype == torch.float32) and kernels_available()):
            _note("kernel")  # a few rows stream the plain weight faster than oneDNN reads its packed copy
            return rows_matmul(x, weight, None if bias is None else bias.contiguous())
        if rows != 1:
            copy = None if packed is None else packed.get()
            if copy is not None:
                _note("packed")
                return torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")
        elif (weight.dtype == torch.float32 and x.is_contiguous() and row_major(weight)
              and (bias is None or bias.dtype == torch.float32) and kernels_available()):
            _note("kernel")
            return row_matmul(x, weight, None if bias is None else bias.contiguous())
        if (x.numel() <= SPLIT_MAX_ROWS * x.shape[-1] and weight.dtype == torch.float32 and weight.is_contiguous()
                and weight.shape[0] % 2 == 0 and torch.get_num_threads() > 1):
            _note("split")
            return _split_matmul(x, weight, bias)
    _note("torch")
    return F.linear(x, weight, bias)


def dequant_serving_linear(x: torch.Tensor, weight: Optional[TypedWeight], bias: Optional[torch.Tensor],
                           dense: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, dense(), bias)`` for a bf16 or quantized weight that ``weight`` describes
    (None: not readable by the kernels), ``dense()`` giving it as a float tensor: up to
    ``DEQUANT_MAX_ROWS`` rows of a matmul without autograd through ``dequant_matmul``,
    ``MAX_DEQUANT_ROWS`` rows a pass (in fp32, the result cast back to x's dtype), more rows
    through ``dense_matmul`` (slabs of the weight widened in C), an int4 weight from
    ``INTEGER_MIN_ROWS`` rows on, an interleaved int4 or int8 one past ``MAX_DEQUANT_ROWS``,
    and past ``DEQUANT_MAX_ROWS`` an int8 one where ``integer_int8_available()``, through
    ``integer_matmul``, anything else through torch over ``dense()``, made once for the call. An int8 or int4 weight multiplies ``x``
    rounded as ``quantize_activations`` does on every path, as QuantizedLinear's forward
    does: the kernels round fp32 rows themselves, exactly so, and torch's path takes
    ``rounded_activations`` (one native pass). A bf16 weight multiplies ``x`` rounded to bf16
    on every path (W16A16, as llama.cpp's BF16 matmuls; the dequantizing matmul rounds it
    itself), summed in fp32: the products of two bf16 values are exact in fp32, so the paths
    differ only in the order of their additions."""
    rows = x.numel() // max(x.shape[-1], 1)
    native = (weight is not None and x.device.type == "cpu" and x.dtype in SERVED_DTYPES and not torch.is_grad_enabled()
              and x.shape[-1] == weight.in_features)
    integer = weight is not None and (weight.kind in (Q4, Q41) and rows >= INTEGER_MIN_ROWS
                                      or weight.kind == Q4X8 and rows > MAX_DEQUANT_ROWS
                                      or weight.kind in INT8_INTEGER_ROWS and rows > INT8_INTEGER_ROWS[weight.kind]
                                      and integer_int8_available())
    if native and integer and dense_matmul_available():
        _note("kernel")
        out = integer_matmul(x.float().contiguous(), weight, None if bias is None else bias.float().contiguous())
        return out.to(x.dtype)
    if (native and weight.kind == BF16 and rows > DEQUANT_MAX_ROWS and x.dtype == torch.float32
            and bf16_matmul_available()):
        _note("kernel")
        return bf16_matmul(x.contiguous(), weight, None if bias is None else bias.float().contiguous())
    kernel = native and 1 <= rows <= DEQUANT_MAX_ROWS and kernels_available()
    if weight is not None and weight.kind in QUANTIZED_KINDS and not (kernel and x.dtype == torch.float32):
        x = rounded_activations(x)
    if kernel:
        _note("kernel")
        flat = x.reshape(rows, -1).float().contiguous()
        b = None if bias is None else bias.float().contiguous()
        if rows <= MAX_DEQUANT_ROWS:
            out = dequant_matmul(flat, weight, b)
        else:
            out = torch.cat([dequant_matmul(flat[i:i + MAX_DEQUANT_ROWS], weight, b)
                             for i in range(0, rows, MAX_DEQUANT_ROWS)])
        return out.view(*x.shape[:-1], -1).to(x.dtype)
    _note("dense")
    if (native and weight.kind in (BF16, Q8) and not (x.dtype == torch.bfloat16 and native_bf16_matmul())
            and dense_matmul_available()):
        rows_in = x.bfloat16().float() if weight.kind == BF16 else x.float()  # bf16: W16A16
        out = dense_matmul(rows_in.contiguous(), weight, None if bias is None else bias.float().contiguous())
        return out.to(x.dtype)
    weight_values = dense()
    bf16_weight = weight.kind == BF16 if weight is not None else weight_values.dtype == torch.bfloat16
    if bf16_weight and x.dtype == torch.float32:
        x = x.bfloat16().float()
    weight_values = weight_values.to(x.dtype)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not native_bf16_matmul():
        # the same bf16 values multiplied in fp32: torch's bf16 matmul is emulated (slower) here
        out = F.linear(x.float(), weight_values.float(), None if bias is None else bias.to(x.dtype).float())
        return out.to(x.dtype)
    return F.linear(x, weight_values, None if bias is None else bias.to(x.dtype))


@functools.lru_cache(maxsize=1)
def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where torch's bf16 matmul
    beats converting to fp32; elsewhere it is emulated, several times slower than fp32's."""
    flags = set(cpu_flags().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def _split_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a contiguous ``weight`` with an even number of
    outputs, as one ``bmm`` over its two halves of rows (one thread each)."""
    n_out, n_in = weight.shape
    rows = x.reshape(-1, n_in)
    halves = torch.bmm(weight.view(2, n_out // 2, n_in), rows.t().expand(2, n_in, rows.shape[0]))  # [2, out/2, R]
    out = halves.permute(2, 0, 1).reshape(rows.shape[0], n_out)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n_out)


def typed_weight(module: nn.Module) -> Optional[TypedWeight]:
    """How the C kernels read ``module``'s weight: a QuantizedLinear's blocks, a plain linear's
    fp32 or bf16 weight; None for anything else."""
    if isinstance(module, InterleavedQuantizedLinear):
        return TypedWeight(module.qweight, module.scales, Q8X8 if module.bits == 8 else Q4X8, module.in_features)
    if isinstance(module, QuantizedLinear):
        kind = Q8 if module.bits == 8 else Q41 if module.asymmetric else Q4
        return TypedWeight(module.qweight, module.scales, kind, module.in_features)
    if isinstance(module, nn.Linear):
        kind = {torch.float32: F32, torch.bfloat16: BF16}.get(module.weight.dtype)
        return None if kind is None else TypedWeight(module.weight, None, kind, module.in_features)
    return None


class CheckedWeight:
    """A module's ``typed_weight``, checked once and checked again only when the tensors it reads
    were replaced or moved (a cast, a reload into new memory); None while the kernels cannot
    read them. It holds no reference to the module, so a deep copy of the module reads its own."""

    def __init__(self):
        self._stamp: Optional[tuple] = None
        self._weight: Optional[TypedWeight] = None

    def get(self, module: nn.Module) -> Optional[TypedWeight]:
        weight = typed_weight(module)
        if weight is None:
            return None
        stamp = (weight.data.data_ptr(), weight.data.dtype, weight.data.shape,
                 None if weight.scales is None else weight.scales.data_ptr())
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._weight = weight.check()
            except ValueError:
                self._weight = None
        return self._weight


class ServingLinear(Linear):
    """A linear whose forward is ``serving_linear`` over its weight and packed copy (fp32),
    or ``dequant_serving_linear`` (bf16)."""

    packed: Optional[PackedWeight] = None
    checked: Optional[CheckedWeight] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.bfloat16:
            if self.checked is None:
                self.checked = CheckedWeight()
            return dequant_serving_linear(x, self.checked.get(self), self.bias, lambda: self.weight)
        return serving_linear(x, self.weight, self.bias, self.packed)


class ServingQuantizedLinear(QuantizedLinear):
    """A QuantizedLinear whose forward is ``dequant_serving_linear``: the same numbers as its
    own forward (but for the order of the additions), from the packed blocks."""

    checked: Optional[CheckedWeight] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checked is None:
            self.checked = CheckedWeight()
        return dequant_serving_linear(x, self.checked.get(self), self.bias, self.dequantize)


class InterleavedQuantizedLinear(ServingQuantizedLinear):
    """A Q4_0 or Q8_0 ServingQuantizedLinear whose values and scales lie eight rows interleaved
    (the kernels' Q4X8 and Q8X8, interleaved.py), as the few-row kernels read them fastest. Its
    ``dequantize`` and state dict give quantized.py's layout; a state dict loaded into it is
    interleaved again."""

    def dequantize(self) -> torch.Tensor:
        return dequantize_weight(model_values(self.qweight), model_scales(self.scales), self.bits, self.in_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "qweight"] = model_values(self.qweight)
        destination[prefix + "scales"] = model_scales(self.scales)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        _interleave_in_place(self, prefix + "qweight" in state_dict, prefix + "scales" in state_dict)


def _interleave_in_place(module: QuantizedLinear, values: bool = True, scales: bool = True) -> None:
    """Re-lay a module's values and/or scales (model layout) interleaved, in their own memory."""
    with torch.no_grad():
        if values:
            module.qweight.copy_(interleaved_values(module.qweight.clone()))
        if scales:
            module.scales.copy_(interleaved_scales(module.scales.clone()))


def interleavable(module: nn.Module) -> bool:
    """Whether ``module`` is a ServingQuantizedLinear the kernels read faster interleaved: Q4_0
    everywhere, Q8_0 where the CPU multiplies int8 in integers for every row count (VNNI:
    without it a prompt's int8 weight is widened for a float GEMM, which reads the model's layout)."""
    if type(module) is not ServingQuantizedLinear or module.asymmetric:
        return False
    return (module.bits == 4 or integer_int8_available()) and can_interleave(module.qweight, module.scales)


def interleave(module: ServingQuantizedLinear) -> bool:
    """Re-lay a ServingQuantizedLinear's values and scales in place, eight rows interleaved,
    making it an InterleavedQuantizedLinear; False (nothing changed) unless ``interleavable``."""
    if not interleavable(module):
        return False
    _interleave_in_place(module)
    module.__class__ = InterleavedQuantizedLinear
    return True


def stored_weight(module: nn.Module) -> torch.Tensor:
    """The tensor that holds a linear's weight: a QuantizedLinear's values, else ``weight``."""
    return module.qweight if isinstance(module, QuantizedLinear) else module.weight


class JointMatmul:
    """The linears of one group as one matmul over their stacked weight, split afterwards.

    Checks before each matmul that the weights still lie where they were stacked (a caller
    that consented to in-place preparation may assign new tensors); if not, the group runs
    module by module."""

    def __init__(self, modules: Sequence[nn.Module], stacked: "Stacked"):
        self.modules = tuple(modules)
        self.weight = stacked.weight
        self.typed = stacked.typed
        self.bias = stacked.bias
        self.sizes = [m.out_features for m in modules]
        self._addresses = self._member_addresses()
        fp32 = self.typed.kind == F32
        self.packed = PackedWeight(self.weight, [m.weight for m in modules]) if fp32 and onednn_available() else None

    def _member_addresses(self) -> list[int]:
        biases = [0 if m.bias is None else m.bias.data_ptr() for m in self.modules] if self.bias is not None else []
        scales = [m.scales.data_ptr() for m in self.modules if isinstance(m, QuantizedLinear)]
        return [stored_weight(m).data_ptr() for m in self.modules] + scales + biases

    def current(self) -> Optional[torch.Tensor]:
        """The joint weight while every member's weight (its scales, its bias when they were
        stacked) is still its block of it, else None."""
        return self.weight if self._member_addresses() == self._addresses else None

    def typed_weight(self) -> Optional[TypedWeight]:
        """The joint weight as the C kernels read it, while ``current``."""
        return self.typed if self.current() is not None else None

    def _dense(self) -> torch.Tensor:
        typed = self.typed
        bits = 8 if typed.kind in (Q8, Q8X8) else 4
        if typed.kind in INTERLEAVED_KINDS:
            return dequantize_weight(model_values(typed.data), model_scales(typed.scales), bits, typed.in_features)
        if typed.kind in QUANTIZED_KINDS:
            return dequantize_weight(typed.data, typed.scales, bits, typed.in_features)
        return typed.data

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.current() is None:
            return [m(x) for m in self.modules]
        if self.typed.kind == F32:
            out = serving_linear(x, self.weight, self.bias, self.packed)
        else:
            out = dequant_serving_linear(x, self.typed, self.bias, self._dense)
        parts = out.split(self.sizes, dim=-1)
        if self.bias is not None:
            return list(parts)
        return [part if m.bias is None else part + m.bias.to(part.dtype) for part, m in zip(parts, self.modules)]


class _JointProjection:
    """Serving subclasses' ``project``: the module's input projections as one matmul."""

    joint: JointMatmul

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        modules = self.input_projections()
        if modules != self.joint.modules:  # a member replaced since (a LoRA layer): each runs its own
            return [m(x) for m in modules]
        return self.joint(x)


class ServingGQA(_JointProjection, GQA):
    """GQA whose q/k/v (and gate) projections run as one matmul."""


class ServingMLA(_JointProjection, MLA):
    """MLA whose q and latent (and gate) projections run as one matmul."""


class ServingMLP(_JointProjection, MLP):
    """SwiGLU MLP whose gate and up projections run as one matmul."""


SERVING_CLASSES = {GQA: ServingGQA, MLA: ServingMLA, MLP: ServingMLP}


def prepare_for_serving(model: nn.Module) -> None:
    """Re-lay and re-class ``model``'s fp32, bf16 and quantized CPU linears for serving (see the
    module's docstring). The model must be the runner's own: its modules change class and its
    weights' memory moves, off the weight file's mapping too (``release_weight_file``)."""
    with torch.no_grad():
        for module in model.modules():  # a copy taken mid-training: back to the model's own class
            if type(module) is OneDnnLinear:
                module.__class__ = Linear
        in_groups: set[int] = set()
        for module in list(model.modules()):
            serving = SERVING_CLASSES.get(type(module))
            group = module.input_projections() if serving is not None else ()
            stacked = _stack(group, in_groups)
            if stacked is not None:
                module.__class__ = serving
                module.joint = JointMatmul(group, stacked)
                _pack_now(module.joint.packed)
        laid: set[int] = set()
        relaid: list[nn.Module] = []
        for module in model.modules():
            if type(module) is QuantizedLinear and module.qweight.device.type == "cpu":
                module.__class__ = ServingQuantizedLinear
                if id(module.qweight) not in in_groups:  # a stacked group's blocks lie in its joint buffers
                    for tensor in (module.qweight, module.scales):
                        _in_huge_pages(tensor, laid)
                continue
            if type(module) not in (Linear, nn.Linear) or not _movable(module.weight):
                continue
            weight = module.weight
            if id(weight) in in_groups:
                continue
            _in_huge_pages(weight, laid)
            module.__class__ = ServingLinear
            relaid.append(module)
        release_weight_file(model)  # before packing: a pack keeps the tensor it was made from
        _interleave(model)
        for module in relaid:
            if onednn_available() and module.weight.dtype == torch.float32:
                module.packed = PackedWeight(module.weight, [module.weight])
                _pack_now(module.packed)


def _in_huge_pages(tensor: torch.Tensor, laid: set[int]) -> None:
    """Move a weight's values into huge-page memory (huge_pages.py) once, whichever modules share it."""
    if id(tensor) not in laid and tensor.nbytes >= HUGE_PAGE_BYTES and huge_pages_available():
        moved = huge_page_empty(tuple(tensor.shape), tensor.dtype)
        moved.copy_(tensor.data)
        tensor.data = moved
    laid.add(id(tensor))


def _interleave(model: nn.Module) -> None:
    """Lay the model's Q4_0 and Q8_0 weights out eight rows interleaved (``interleave``): a stacked group's
    when every member's can be (the joint weight is then interleaved member by member, which is
    its own interleaved layout), and every other one's. A tensor two modules share stays as it is."""
    stored = Counter(m.qweight.data_ptr() for m in model.modules() if isinstance(m, QuantizedLinear))
    alone = lambda m: type(m) is ServingQuantizedLinear and stored[m.qweight.data_ptr()] == 1
    grouped: set[int] = set()
    for module in model.modules():
        joint = getattr(module, "joint", None)
        if not isinstance(joint, JointMatmul):
            continue
        grouped.update(id(m) for m in joint.modules)
        typed = joint.typed
        if typed.kind in (Q4, Q8) and all(alone(m) and interleavable(m) for m in joint.modules):
            for member in joint.modules:
                interleave(member)
            joint.typed = TypedWeight(typed.data, typed.scales, Q4X8 if typed.kind == Q4 else Q8X8, typed.in_features)
    for module in model.modules():
        if id(module) not in grouped and alone(module):
            interleave(module)


def _pack_now(packed: Optional[PackedWeight]) -> None:
    """Pack while preparing, so that the first request does not wait for it."""
    if packed is not None:
        packed.get()


def _movable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in SERVED_DTYPES and weight.dim() == 2


class Stacked:
    """A group's joint weight: ``weight`` the stacked tensor (the values, for quantized
    members), ``typed`` how the C kernels read it, ``bias`` the stacked biases when every
    member has one (each member's bias then a view of its block), else None."""

    def __init__(self, weight: torch.Tensor, typed: TypedWeight, bias: Optional[torch.Tensor]):
        self.weight, self.typed, self.bias = weight, typed, bias


def _stack(group: Sequence[nn.Module], in_groups: set[int]) -> Optional[Stacked]:
    """Copy the group's weights (values and scales, for quantized members) into joint [total, ...]
    buffers, each member's tensors becoming their block of rows; None when the group is not of
    plain, distinct CPU linears of one kind (fp32, bf16, or quantized in the same bits) and one
    input width."""
    if len(group) < 2:
        return None
    quantized = all(type(m) is QuantizedLinear for m in group)
    if not quantized and any(type(m) not in (Linear, nn.Linear) for m in group):
        return None
    stored = [stored_weight(m) for m in group]
    kinds = {typed_weight(m).kind if typed_weight(m) is not None else None for m in group}
    if (any(id(w) in in_groups for w in stored) or len({id(w) for w in stored}) < len(stored) or len(kinds) != 1
            or None in kinds or not all(w.device.type == "cpu" and w.dim() == 2 for w in stored)
            or len({m.in_features for m in group}) > 1 or len({w.shape[1] for w in stored}) > 1):
        return None
    in_groups.update(id(w) for w in stored)
    weight = _concatenate(stored)
    scales = _concatenate([m.scales for m in group]) if quantized else None
    biases = [m.bias for m in group]
    bias = None
    if all(b is not None for b in biases) and len({b.dtype for b in biases}) == 1:
        bias = _concatenate(biases)
    return Stacked(weight, TypedWeight(weight, scales, kinds.pop(), group[0].in_features), bias)


def _concatenate(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One buffer holding ``tensors`` one after the other along their first dimension, each
    tensor's ``.data`` becoming its block."""
    first = tensors[0]
    buffer = huge_page_empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.dtype)
    start = 0
    for tensor in tensors:
        block = buffer[start:start + tensor.shape[0]]
        block.copy_(tensor.data)
        tensor.data = block
        start += tensor.shape[0]
    return buffer
