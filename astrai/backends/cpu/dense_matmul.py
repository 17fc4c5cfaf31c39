"""Many rows (a prefill) by a bf16 or block-quantized weight.

``integer_matmul`` multiplies by an int4 weight (and, on a CPU with VNNI, an int8 one) in
integers (W4A8, W8A8, native/integer_matmul.c): the activations rounded to Q8_0 blocks, as
every quantized path rounds them, times the weight's bytes, 32 multiply-adds per instruction,
about twice an fp32 matmul's rate on the same cores.

``bf16_matmul`` multiplies by a bf16 weight on a CPU with AVX512-BF16 (W16A16,
native/bf16_matmul.c): the activations rounded to bf16, as every bf16 path rounds them, two
products added per lane by ``vdpbf16ps``, twice an fp32 FMA's multiply-adds.

``dense_matmul`` serves the other types (and bf16 elsewhere). A prompt's GEMM is compute
bound: it wants oneDNN's (or the BLAS's) fp32 GEMM. Dequantizing
in torch for each call makes several passes and a fresh allocation the size of the fp32 weight
(page faults included); instead native/dense_rows.c widens the weight in one threaded pass,
``SLAB_BYTES`` of fp32 rows at a time, into a buffer that this thread keeps, and every row of the
prompt is multiplied by each slab in turn. The numbers are those of ``F.linear`` over the
dequantized weight (int8: and the rounded activations its caller passes), summed in another order.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from astrai.backends.cpu.kernels import (BF16, FEATURE_BF16, FEATURE_VNNI, INT4_KINDS, INT8_KINDS, Q8, TypedWeight,
                                         _library, fits_bias, kernel_features)

# fp32 weight rows widened per matmul: a whole projection of a small model, or a few slabs of a
# large one's, bounding the buffer each thread keeps
SLAB_BYTES = 32 << 20
_scratch = threading.local()  # each thread's slab buffer: the engine may run in a worker thread


def _dense_rows() -> Optional[ctypes._CFuncPtr]:
    """The C widening of the library loaded now (none without it), its argument types set once."""
    library = _library()
    if library is None:
        return None
    function = library.astrai_dense_rows  # ctypes keeps one function object per library
    if function.argtypes is None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        function.argtypes = [ptr, i64, ptr, i64, ctypes.c_int, i64, i64, i64, ptr, i64, ctypes.c_int]
        function.restype = i64
    return function


def dense_matmul_available() -> bool:
    """Whether the native widening is built (else the caller dequantizes the whole weight)."""
    return _dense_rows() is not None


def _slab_buffer(elements: int) -> torch.Tensor:
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < elements:
        buffer = _scratch.buffer = torch.empty(elements, dtype=torch.float32)
    return buffer


def release_slab_buffer() -> None:
    """Free this thread's slab buffer: for a thread that multiplies prompts only now and then."""
    _scratch.__dict__.pop("buffer", None)


def slab_rows(n_in: int) -> int:
    """Weight rows widened at a time for ``n_in`` inputs: ``SLAB_BYTES`` of fp32 (a multiple of 16)."""
    return max(16, (SLAB_BYTES // (4 * max(n_in, 1))) // 16 * 16)


@functools.lru_cache(maxsize=1)
def _onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _matmul(rows: torch.Tensor, slab: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(rows, slab, bias)``: through oneDNN where the build has it (its GEMM over a
    plain fp32 weight beats the BLAS's on many rows), else the BLAS."""
    if _onednn_linear():
        return torch.ops.mkldnn._linear_pointwise(rows, slab, bias, "none", [], "")
    return F.linear(rows, slab, bias)


def _prompt_rows(x: torch.Tensor, weight: TypedWeight, bias: Optional[torch.Tensor], kinds: tuple[int, ...],
                 name: str) -> torch.Tensor:
    """``x`` as contiguous rows [rows, in], after checking that ``name`` takes it, ``weight``
    (one of ``kinds``) and ``bias`` (ValueError otherwise)."""
    if weight.kind not in kinds or x.dtype != torch.float32 or x.shape[-1] != weight.in_features:
        raise ValueError(f"{name}: unsupported weight kind, dtype or width")
    if not fits_bias(bias, weight.out_features):
        raise ValueError(f"{name}: the bias must be fp32, contiguous, one value per output ({weight.out_features})")
    weight.check()
    return x.reshape(-1, weight.in_features).contiguous()


def integer_int8_available() -> bool:
    """Whether ``integer_matmul`` takes int8 weights: the library was built with VNNI (without
    it, the int8 values stored unsigned as w + 128 would overflow maddubs' 16-bit pair sums,
    and a prompt's int8 weight is widened for ``dense_matmul`` instead)."""
    return dense_matmul_available() and bool(kernel_features() & FEATURE_VNNI)


def integer_matmul(x: torch.Tensor, weight: TypedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(quantize_activations(x), w, bias)`` for ``x`` [..., in] fp32 and the int4 weight
    ``w`` (Q4_0 or Q4_1 blocks, or Q4_0 interleaved), or where ``integer_int8_available()`` the
    int8 one (Q8_0, or interleaved), that ``weight`` describes, dequantized: native/integer_matmul.c rounds ``x`` to Q8_0 blocks and
    sums each block's products in integers. Call only when ``dense_matmul_available()``."""
    n_in, n_out = weight.in_features, weight.out_features
    kinds = (*INT4_KINDS, *INT8_KINDS) if integer_int8_available() else INT4_KINDS
    rows = _prompt_rows(x, weight, bias, kinds, "integer_matmul")
    out = torch.empty(rows.shape[0], n_out, dtype=torch.float32)
    data, data_ld, scales, scale_ld, kind = weight.pointers()
    status = _library().astrai_integer_matmul(rows.data_ptr(), rows.shape[0], n_in, data, data_ld, scales, scale_ld,
                                              kind, 0 if bias is None else bias.data_ptr(), out.data_ptr(), n_out,
                                              n_in, n_out, max(torch.get_num_threads(), 1))
    if status == -2:
        raise MemoryError("integer_matmul: no memory for the quantized rows")
    return out.view(*x.shape[:-1], n_out)


def bf16_matmul_available() -> bool:
    """Whether ``bf16_matmul`` runs here: the library was built with AVX512-BF16 (the
    ``avx512_bf16`` level, on a CPU that reports it)."""
    return dense_matmul_available() and bool(kernel_features() & FEATURE_BF16)


def bf16_matmul(x: torch.Tensor, weight: TypedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x.bfloat16().float(), w, bias)`` for ``x`` [..., in] fp32 and the bf16 weight
    ``w`` that ``weight`` describes, summed in fp32 (native/bf16_matmul.c). Call only when
    ``bf16_matmul_available()``."""
    n_in, n_out = weight.in_features, weight.out_features
    rows = _prompt_rows(x, weight, bias, (BF16,), "bf16_matmul")
    out = torch.empty(rows.shape[0], n_out, dtype=torch.float32)
    data, data_ld, _, _, _ = weight.pointers()
    status = _library().astrai_bf16_matmul(rows.data_ptr(), rows.shape[0], n_in, data, data_ld,
                                           0 if bias is None else bias.data_ptr(), out.data_ptr(), n_out, n_in, n_out,
                                           max(torch.get_num_threads(), 1))
    if status == -1:
        raise ValueError("bf16_matmul: this build has no AVX512-BF16 (see bf16_matmul_available)")
    if status == -2:
        raise MemoryError("bf16_matmul: no memory for the rounded rows")
    return out.view(*x.shape[:-1], n_out)


def dense_matmul(x: torch.Tensor, weight: TypedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` in fp32 for ``x`` [..., in] fp32 and the bf16 or int8 weight
    ``w`` that ``weight`` describes, dequantized; ``bias`` fp32 [out] or None. Call only when
    ``dense_matmul_available()``."""
    n_in, n_out = weight.in_features, weight.out_features
    rows = _prompt_rows(x, weight, bias, (BF16, Q8), "dense_matmul")
    data, data_ld, scales, scale_ld, kind = weight.pointers()
    step = min(slab_rows(n_in), n_out)
    buffer = _slab_buffer(step * n_in)
    out = torch.empty(rows.shape[0], n_out, dtype=torch.float32) if step < n_out else None
    widen = _dense_rows()
    threads = max(torch.get_num_threads(), 1)
    for first in range(0, n_out, step):
        count = min(step, n_out - first)
        slab = buffer[:count * n_in].view(count, n_in)
        widen(data, data_ld, scales, scale_ld, kind, n_in, first, count, slab.data_ptr(), n_in, threads)
        part_bias = None if bias is None else bias[first:first + count]
        if count == n_out:
            return _matmul(rows, slab, part_bias).view(*x.shape[:-1], n_out)
        out[:, first:first + count] = _matmul(rows, slab, part_bias)
    return out.view(*x.shape[:-1], n_out)
