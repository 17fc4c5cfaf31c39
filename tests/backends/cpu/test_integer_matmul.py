"""Many rows by an int4 weight, and on a CPU with VNNI an int8 one, in integers
(astrai/backends/cpu/native/integer_matmul.c through dense_matmul.integer_matmul): equal to
the float64 product of the activations rounded to Q8_0 blocks and the dequantized Q4_0, Q4_1
or Q8_0 weight on shapes that are not multiples of a
block, of the eight rows unpacked together or of a thread's share; a NaN or an infinity poisons
its row as in the reference; a block of a stacked weight reads its own rows; the serving
linear takes this kernel from four rows on (prefill and batched decode alike); the plain-C
build gives the same sums."""

from __future__ import annotations

import pytest
import torch

from astrai.backends.cpu import dense_matmul as dense
from astrai.backends.cpu import kernels, serving
from astrai.backends.cpu.kernels import BF16, Q4, Q8, Q41, TypedWeight, kernels_available
from astrai.model.quantized import dequantize_weight, quantize_activations, quantize_weight
from test_dequant_matmul_kernel import multiplied, typed

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")
# int8 weights multiply in integers where the kernels have VNNI; elsewhere they are refused (below)
KINDS = [Q4, Q41] + ([Q8] if kernels_available() and dense.integer_int8_available() else [])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_out,n_in,rows", [(37, 45, 17), (5, 31, 1), (70, 96, 601), (23, 64, 50), (129, 200, 6),
                                               (16, 1000, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_many_rows_equal_the_float64_product_of_the_rounded_activations(kind, n_out, n_in, rows, with_bias,
                                                                      monkeypatch):
    torch.manual_seed(n_out * n_in + rows)
    # groups of eight weight rows shared unevenly among 3 threads, in pairs from 25 rows of x
    # on (the last pair a single group when their count is odd), and rows of x left over from
    # passes of four (one group) or three (a pair)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    weight, reference = typed(torch.randn(n_out, n_in), kind)
    x = torch.randn(2, rows, n_in) * torch.rand(n_in).add(0.5)
    x[..., :min(n_in, 32)] = 0.0  # a block of zeros: d = 0
    bias = torch.randn(n_out) if with_bias else None
    got = dense.integer_matmul(x, weight, bias)
    want = multiplied(x, kind) @ reference.t() + (0 if bias is None else bias.double())
    assert got.shape == (2, rows, n_out) and got.dtype == torch.float32
    # one activation rounded a step the other way would move an output by about 1e-2
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_an_infinity_or_a_nan_makes_its_row_nan_as_the_reference_does(kind):
    torch.manual_seed(1)
    weight, reference = typed(torch.randn(20, 70), kind)
    x = torch.randn(4, 70)
    x[1, 40], x[2, 3] = float("inf"), float("nan")
    got = dense.integer_matmul(x, weight)
    want = torch.nn.functional.linear(quantize_activations(x).double(), reference)
    assert torch.equal(got.isnan(), want.isnan()) and got[1:3].isnan().all()
    assert torch.allclose(got[[0, 3]].double(), want[[0, 3]], rtol=0, atol=2e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_of_a_stacked_weight_reads_only_its_rows(kind):
    """A member of a joint weight: a view of some of its rows, its scales further apart too."""
    torch.manual_seed(2)
    bits = 8 if kind == Q8 else 4
    values, scales = quantize_weight(torch.randn(50, 64), bits, asymmetric=kind == Q41)
    block = TypedWeight(values[10:29], scales[10:29], kind, 64)
    x = torch.randn(9, 64)
    want = multiplied(x, kind) @ dequantize_weight(values, scales, bits, 64)[10:29].double().t()
    assert torch.allclose(dense.integer_matmul(x, block).double(), want, rtol=0, atol=2e-4)


def test_it_refuses_what_it_cannot_multiply():
    weight, _ = typed(torch.randn(8, 32), BF16)
    with pytest.raises(ValueError, match="integer_matmul"):
        dense.integer_matmul(torch.randn(4, 32), weight)
    if not dense.integer_int8_available():  # int8 needs VNNI: maddubs' pair sums would overflow
        weight, _ = typed(torch.randn(8, 32), Q8)
        with pytest.raises(ValueError, match="integer_matmul"):
            dense.integer_matmul(torch.randn(4, 32), weight)
    weight, _ = typed(torch.randn(8, 32), Q4)
    with pytest.raises(ValueError, match="integer_matmul"):
        dense.integer_matmul(torch.randn(4, 31), weight)


def count_integer_matmuls(monkeypatch) -> list:
    """A list that gains an item for each call of integer_matmul by the serving linear."""
    calls = []
    real = dense.integer_matmul
    monkeypatch.setattr(serving, "integer_matmul", lambda *args: calls.append(1) or real(*args))
    return calls


@pytest.mark.parametrize("kind", [Q4, Q41])
@pytest.mark.parametrize("rows", [serving.INTEGER_MIN_ROWS, serving.DEQUANT_MAX_ROWS + 1, 64])
def test_the_serving_linear_takes_this_kernel_from_four_rows(kind, rows, monkeypatch):
    """Four rows or more (a batched decode step or a prompt) go through integer_matmul and
    match torch over the dequantized weight and rounded activations; fewer take the dequantizing
    matmul, which reads the weight once."""
    torch.manual_seed(3)
    weight, reference = typed(torch.randn(48, 40), kind)
    bias = torch.randn(48)
    calls = count_integer_matmuls(monkeypatch)
    with torch.no_grad():
        x = torch.randn(rows, 40)
        fast = serving.dequant_serving_linear(x, weight, bias, lambda: reference.float())
        serving.dequant_serving_linear(x[:serving.INTEGER_MIN_ROWS - 1], weight, bias, lambda: reference.float())
        monkeypatch.setattr(serving, "dense_matmul_available", lambda: False)
        monkeypatch.setattr(serving, "kernels_available", lambda: False)
        fallback = serving.dequant_serving_linear(x, weight, bias, lambda: reference.float())
    assert len(calls) == 1
    assert torch.allclose(fast, fallback, rtol=0, atol=2e-4)


@pytest.mark.parametrize("rows", [serving.INTEGER_MIN_ROWS, serving.DEQUANT_MAX_ROWS, serving.DEQUANT_MAX_ROWS + 1, 64])
def test_an_int8_prompt_takes_this_kernel_where_the_cpu_has_vnni(rows, monkeypatch):
    """An int8 weight reads once for a decode step's few rows (the dequantizing matmul) and
    multiplies a prompt's rows in integers where VNNI is built in, else widened for oneDNN:
    the same numbers either way."""
    torch.manual_seed(5)
    weight, reference = typed(torch.randn(48, 40), Q8)
    calls = count_integer_matmuls(monkeypatch)
    with torch.no_grad():
        x = torch.randn(rows, 40)
        fast = serving.dequant_serving_linear(x, weight, None, lambda: reference.float())
    want = multiplied(x, Q8) @ reference.t()
    assert len(calls) == (rows > serving.DEQUANT_MAX_ROWS and dense.integer_int8_available())
    assert torch.allclose(fast.double(), want, rtol=0, atol=2e-4)


def test_the_portable_build_gives_the_same_sums(monkeypatch):
    """ASTRAI_PORTABLE_KERNELS=1 builds the plain-C loops: the same integer sums, the float
    additions in another order."""
    torch.manual_seed(4)
    cases = [(typed(torch.randn(45, 100), kind)[0], torch.randn(30, 100)) for kind in (Q4, Q41)]
    native = [dense.integer_matmul(x, w) for w, x in cases]
    monkeypatch.setenv("ASTRAI_PORTABLE_KERNELS", "1")
    kernels._library.cache_clear()
    try:
        portable = [dense.integer_matmul(x, w) for w, x in cases]
    finally:
        monkeypatch.delenv("ASTRAI_PORTABLE_KERNELS")
        kernels._library.cache_clear()
    for a, b in zip(native, portable):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-5)
