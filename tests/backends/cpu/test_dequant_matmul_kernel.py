"""The dequantizing matmuls (astrai/backends/cpu/native/dequant_matmul.c through kernels.dequant_matmul):
one to eight rows against int8 and int4 blocks (Q4_0's and Q4_1's), bf16 and fp32 weights equal the float64 product with
the dequantized weight (int8 and int4: of the activations rounded to Q8_0 blocks, the integer
sums of the kernel; bf16: of the activations rounded to bf16), on shapes that are not multiples of a block or of a thread's stretch, and the
plain-C build forced by ASTRAI_PORTABLE_KERNELS gives the same numbers."""

from __future__ import annotations

import pytest
import torch

from astrai.backends.cpu import kernels
from astrai.backends.cpu.interleaved import interleaved_scales, interleaved_values
from astrai.backends.cpu.kernels import (BF16, F32, Q4, Q4X8, Q8, Q8X8, Q41, TypedWeight, kernels_available,
                                        rounded_activations, dequant_matmul)
from astrai.model.quantized import dequantize_weight, quantize_activations, quantize_weight

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

BITS = {Q8: 8, Q4: 4, Q41: 4, Q4X8: 4, Q8X8: 8}


def typed(weight: torch.Tensor, kind: int) -> tuple[TypedWeight, torch.Tensor]:
    """The weight in ``kind`` and the float64 weight it stands for (Q4X8, Q8X8: a multiple of 8 rows)."""
    n_in = weight.shape[1]
    if kind in BITS:
        values, scales = quantize_weight(weight, BITS[kind], asymmetric=kind == Q41)
        reference = dequantize_weight(values, scales, BITS[kind], n_in).double()
        if kind in (Q4X8, Q8X8):
            values, scales = interleaved_values(values), interleaved_scales(scales)
        return TypedWeight(values, scales, kind, n_in), reference
    stored = weight.to(torch.bfloat16 if kind == BF16 else torch.float32)
    return TypedWeight(stored, None, kind, n_in), stored.double()


def multiplied(x: torch.Tensor, kind: int) -> torch.Tensor:
    """The activations a matmul of ``kind`` multiplies, in float64: int8 and int4 round them to
    Q8_0 blocks, bf16 to bf16."""
    if kind == BF16:
        return x.bfloat16().double()
    return (quantize_activations(x) if kind in (Q8, Q4, Q41) else x).double()


@pytest.mark.parametrize("kind", [Q8, Q4, Q41, BF16, F32])
@pytest.mark.parametrize("n_out,n_in", [(37, 45), (5, 31), (70, 96), (129, 200)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_dequant_matmul_equals_the_float64_product_of_the_dequantized_weight(kind, n_out, n_in, rows, monkeypatch):
    torch.manual_seed(n_out * n_in + rows)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # stretches of 13, 2, 24, 43 rows: uneven ends
    weight, reference = typed(torch.randn(n_out, n_in), kind)
    x, bias = torch.randn(rows, n_in), torch.randn(n_out)
    for b in (None, bias):
        want = torch.nn.functional.linear(multiplied(x, kind), reference, None if b is None else b.double())
        got = dequant_matmul(x, weight, b)
        assert got.shape == (rows, n_out) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", [Q8, Q4, Q41])
def test_rows_further_apart_and_subnormal_scales_are_read(kind):
    """A block of a stacked weight reads with its own row stride, and scales too small for a
    normal fp16 convert exactly (the portable conversion's hardest case)."""
    torch.manual_seed(1)
    weight, _ = typed(torch.randn(12, 64) * 1e-6, kind)  # scales around 1e-7: fp16 subnormals
    assert (weight.scales.float().abs() < 6.1e-5).any()
    wide_values = torch.cat([weight.data, torch.zeros_like(weight.data)], dim=1)[:, :weight.data.shape[1]]
    wide_scales = torch.cat([weight.scales, weight.scales], dim=1)[:, :weight.scales.shape[1]]
    strided = TypedWeight(wide_values, wide_scales, kind, 64)
    x = torch.randn(2, 64)
    dense = dequantize_weight(weight.data, weight.scales, BITS[kind], 64).double()
    want = multiplied(x, kind) @ dense.T
    assert torch.allclose(dequant_matmul(x, strided).double(), want, atol=1e-12, rtol=1e-5)


@pytest.mark.parametrize("n_in", [7, 45, 96, 1000])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("kind", [Q8, Q4, Q41])
def test_quantized_matmuls_round_the_activations_as_the_reference_does(n_in, rows, kind, monkeypatch):
    """The kernel's int8/int4 x int8 block sums must round the activations exactly as
    quantize_activations does: with blocks of similar magnitude the float error stays far below
    what one value rounded one step the other way would change (about 1e-3 here), a partial
    last block and a block of zeros (d = 0) included."""
    torch.manual_seed(n_in + rows)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    weight, dense = typed(torch.randn(23, n_in), kind)
    x = torch.randn(rows, n_in) * torch.rand(n_in).add(0.5)
    x[:, :min(n_in, 32)] = 0.0
    want = multiplied(x, kind) @ dense.T
    assert torch.allclose(dequant_matmul(x, weight).double(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("rows", [1, 4])
def test_bf16_weights_multiply_the_activations_rounded_to_bf16_as_torch_rounds(rows, monkeypatch):
    """Through the identity matrix in bf16 the kernel returns the activations it multiplied:
    bit for bit torch's ``.bfloat16()`` (ties to even, the largest and smallest normal values;
    vdpbf16ps flushes subnormal ones to zero), on every thread's stretch."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    n = 40
    one_step = 2.0 ** -7  # bf16's step just above 1
    ties = torch.tensor([1 + one_step / 2, 1 + 3 * one_step / 2, -(1 + one_step / 2), 3.38e38, 1.5e-38, -2.5e-38, 0.1])
    x = torch.randn(rows, n)
    x[0, :len(ties)] = ties
    got = dequant_matmul(x, TypedWeight(torch.eye(n).bfloat16(), None, BF16, n))
    assert torch.equal(got, x.bfloat16().float())
    assert got[0, 0] == 1.0 and got[0, 1] == 1 + 2 * one_step and got[0, 2] == -1.0


@pytest.mark.parametrize("shape", [(1, 7), (5, 45), (3, 96), (512, 200)])
def test_native_rounding_of_activations_equals_quantize_activations(shape, monkeypatch):
    """A prompt's int4 matmuls round their activations in C: bit for bit torch's rounding,
    with a zero block (d = 0), a partial last block, an infinity and a NaN (their blocks NaN)."""
    torch.manual_seed(shape[0] * shape[1])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    x = torch.randn(shape) * torch.rand(shape[1]).add(0.01) * 30
    if shape[1] > 32:
        x[:, :32] = 0.0
    if shape[0] > 2:
        x[1, -1], x[2, 0] = float("inf"), float("nan")
    got, want = rounded_activations(x), quantize_activations(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not torch.equal(got, x.nan_to_num())  # it rounds
    assert torch.equal(rounded_activations(x[:, :0].contiguous()), x[:, :0])


def test_dequant_matmul_refuses_what_it_cannot_read():
    values, scales = quantize_weight(torch.randn(8, 40), 8)
    good = TypedWeight(values, scales, Q8, 40)
    with pytest.raises(ValueError):
        dequant_matmul(torch.randn(9, 40), good)  # more rows than one pass takes
    with pytest.raises(ValueError):
        dequant_matmul(torch.randn(1, 40).double(), good)
    with pytest.raises(ValueError):
        dequant_matmul(torch.randn(1, 40), TypedWeight(values, scales[:, :1], Q8, 40))  # scales for one block
    with pytest.raises(ValueError):
        dequant_matmul(torch.randn(1, 40), TypedWeight(values.to(torch.uint8), scales, Q8, 40))
    with pytest.raises(ValueError):
        dequant_matmul(torch.randn(9, 40), TypedWeight(torch.randn(8, 40), None, F32, 40))  # fp32 rows: the same limit
    nibbles, steps = quantize_weight(torch.randn(8, 40), 4, asymmetric=True)
    with pytest.raises(ValueError):  # Q4_1 without its minimums after the scales
        dequant_matmul(torch.randn(1, 40), TypedWeight(nibbles, steps[:, :2], Q41, 40))


def test_the_portable_build_gives_the_same_matmuls(monkeypatch):
    """ASTRAI_PORTABLE_KERNELS=1 builds the plain-C form for the generic target: no intrinsics,
    the same matmuls (summed in another order)."""
    torch.manual_seed(2)
    cases = [(typed(torch.randn(33, 70), kind)[0], torch.randn(3, 70)) for kind in (Q8, Q4, Q41, BF16, F32)]
    native = [dequant_matmul(x, w) for w, x in cases]
    monkeypatch.setenv("ASTRAI_PORTABLE_KERNELS", "1")
    kernels._library.cache_clear()
    try:
        assert kernels_available() and not kernels.dequant_matmul_vectorised()
        portable = [dequant_matmul(x, w) for w, x in cases]
    finally:
        monkeypatch.delenv("ASTRAI_PORTABLE_KERNELS")
        kernels._library.cache_clear()
    for a, b in zip(native, portable):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-5)


def test_a_cpu_with_avx2_and_fma_gets_the_vectorised_build():
    flags = kernels.cpu_flags().split()
    if "avx2" in flags and "fma" in flags:
        assert kernels.dequant_matmul_vectorised()


def test_values_near_a_tie_round_as_the_reference_does():
    """Blocks holding a value next to a tie (about 8.5 d): rounded with 127 / max|x| instead
    (what a compiler's reciprocal folding would make of 1 / (max|x| / 127)) some round the
    other way; the kernels' rounding must still equal quantize_activations'."""
    torch.manual_seed(7)
    largest = torch.rand(20000, 1) * 10 + 0.1
    d = largest * (1 / 127)
    x = torch.cat([largest, d * 8.5, -d * 20.5, torch.randn(20000, 29) * d], dim=1)
    folded = torch.round(x * torch.full_like(largest, 127).div(largest)) * d.half().float()
    want = quantize_activations(x)
    near_ties = (folded != want).any(dim=-1)
    assert near_ties.sum() > 100
    x, want = x[near_ties].contiguous(), want[near_ties]
    assert torch.equal(rounded_activations(x), want)
    # the matmuls round them too: through the identity (near 1 on the diagonal) each output
    # is its rounded input, to float error far below a step d (at least 1e-3 here)
    from astrai.backends.cpu.dense_matmul import integer_matmul
    for kind in (Q4, Q41):
        identity, reference = typed(torch.eye(32), kind)
        through = want.double() @ reference.t()
        assert torch.allclose(dequant_matmul(x[:8], identity).double(), through[:8], rtol=0, atol=1e-5)
        assert torch.allclose(integer_matmul(x, identity).double(), through, rtol=0, atol=1e-5)
