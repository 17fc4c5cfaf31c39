"""A prefill's matmul over bf16 and int8 weights (astrai/backends/cpu/dense_matmul.py and
native/dense_rows.c; int4 has its integer matmul, test_integer_matmul.py): many rows equal the float64 product with the dequantized weight on shapes
that are not multiples of a block, over one slab or several; the widening is exact (every
fp16 scale, subnormal ones too); each thread keeps its own buffer; the serving linear takes
this kernel for many rows and falls back to torch without the native library; the plain-C
build gives the same numbers."""

from __future__ import annotations

import threading

import pytest
import torch

from astrai.backends.cpu import dense_matmul as dense
from astrai.backends.cpu import kernels, serving
from astrai.backends.cpu.kernels import BF16, Q4, Q8, TypedWeight, kernels_available
from astrai.model.quantized import dequantize_weight, quantize_weight
from test_dequant_matmul_kernel import typed  # the weight in a kind and the float64 weight it stands for

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

@pytest.mark.parametrize("kind", [Q8, BF16])
@pytest.mark.parametrize("n_out,n_in,rows", [(37, 45, 17), (70, 96, 600), (129, 200, 33), (16, 31, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_many_rows_equal_the_float64_product_of_the_dequantized_weight(kind, n_out, n_in, rows, with_bias):
    torch.manual_seed(n_out * n_in + rows)
    weight, reference = typed(torch.randn(n_out, n_in), kind)
    x = torch.randn(2, rows, n_in)
    bias = torch.randn(n_out) if with_bias else None
    got = dense.dense_matmul(x, weight, bias)
    want = x.double() @ reference.t() + (0 if bias is None else bias.double())
    assert got.shape == (2, rows, n_out) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", [Q8, BF16])
def test_several_slabs_and_a_short_last_one_give_the_same_matmul(kind, monkeypatch):
    """A weight wider than one slab is widened and multiplied slab by slab, the last one shorter."""
    torch.manual_seed(1)
    weight, reference = typed(torch.randn(83, 70), kind)
    x, bias = torch.randn(40, 70), torch.randn(83)
    monkeypatch.setattr(dense, "SLAB_BYTES", 16 * 70 * 4)
    assert dense.slab_rows(70) == 16
    got = dense.dense_matmul(x, weight, bias)
    assert torch.allclose(got.double(), x.double() @ reference.t() + bias.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", [Q8, BF16])
def test_the_widening_is_exact(kind):
    """The identity's product is the dequantized weight itself, bit for bit: scales that are
    subnormal, tiny and huge in fp16 included, and inputs past the last whole block."""
    torch.manual_seed(2)
    n_in = 77
    weight = torch.randn(12, n_in) * torch.tensor([1e-9, 1e-7, 3e-6, 1e-3, 1, 50, 3e3, 6e4, 1, 1, 1, 1])[:, None]
    typed_weight, reference = typed(weight, kind)
    got = dense.dense_matmul(torch.eye(n_in), typed_weight)
    assert torch.equal(got, reference.float().t())


def test_a_block_of_a_stacked_weight_reads_only_its_rows():
    """A member of a joint weight: a view of some of its rows, further apart than the block."""
    torch.manual_seed(3)
    values, scales = quantize_weight(torch.randn(50, 64), 8)
    block = TypedWeight(values[10:30], scales[10:30], Q8, 64)
    x = torch.randn(20, 64)
    want = x @ dequantize_weight(values, scales, 8, 64)[10:30].t()
    assert torch.allclose(dense.dense_matmul(x, block), want, atol=1e-4, rtol=1e-4)


def test_each_thread_keeps_its_own_buffer():
    """Threads multiplying at once never share the slab buffer (each has its own, right results)."""
    torch.manual_seed(4)
    weights = [typed(torch.randn(60 + i, 96), Q8) for i in range(4)]
    xs = [torch.randn(25, 96) for _ in weights]
    results, buffers = {}, {}

    def work(i):
        for _ in range(20):
            results[i] = dense.dense_matmul(xs[i], weights[i][0])
        buffers[i] = dense._scratch.buffer

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(weights))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, (_, reference) in enumerate(weights):
        assert torch.allclose(results[i].double(), xs[i].double() @ reference.t(), atol=1e-4, rtol=1e-4)
    assert len({buffer.data_ptr() for buffer in buffers.values()}) == len(weights)


@pytest.mark.parametrize("kind", [Q8, BF16])
def test_the_serving_linear_takes_this_kernel_for_many_rows_and_torch_without_it(kind, monkeypatch):
    torch.manual_seed(5)
    weight, reference = typed(torch.randn(48, 40), kind)
    x, bias = torch.randn(serving.DEQUANT_MAX_ROWS + 1, 40), torch.randn(48)
    calls = []
    real = dense.dense_matmul
    monkeypatch.setattr(serving, "dense_matmul", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(serving, "integer_int8_available", lambda: False)  # int8 widened, as without VNNI
    monkeypatch.setattr(serving, "bf16_matmul_available", lambda: False)  # bf16 widened, as without AVX512-BF16
    with torch.no_grad():
        fast = serving.dequant_serving_linear(x, weight, bias, lambda: reference.float())
        monkeypatch.setattr(serving, "dense_matmul_available", lambda: False)
        fallback = serving.dequant_serving_linear(x, weight, bias, lambda: reference.float())
    assert len(calls) == 1
    assert torch.allclose(fast, fallback, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, serving.DEQUANT_MAX_ROWS + 1, 200])
def test_a_bf16_serving_linear_multiplies_the_activations_rounded_to_bf16_on_every_path(rows, monkeypatch):
    """W16A16 whatever the rows: the dequantizing matmul, the prompt's bf16 matmul (where the CPU
    has it), the widened prompt matmul and torch's fallback all equal the float64 product of the
    bf16-rounded activations (far closer than the unrounded product, about 1e-2 away here)."""
    torch.manual_seed(rows)
    weight, reference = typed(torch.randn(48, 256), BF16)
    x = torch.randn(rows, 256)
    want = x.bfloat16().double() @ reference.t()
    assert not torch.allclose(x.double() @ reference.t(), want, atol=1e-3)
    with torch.no_grad():
        got = [serving.dequant_serving_linear(x, weight, None, lambda: weight.data)]
        monkeypatch.setattr(serving, "bf16_matmul_available", lambda: False)
        got.append(serving.dequant_serving_linear(x, weight, None, lambda: weight.data))
        monkeypatch.setattr(serving, "dense_matmul_available", lambda: False)
        monkeypatch.setattr(serving, "kernels_available", lambda: False)
        got.append(serving.dequant_serving_linear(x, weight, None, lambda: weight.data))
        got.append(serving.dequant_serving_linear(x, None, None, lambda: weight.data))  # the kernels cannot read it
    for out in got:
        assert torch.allclose(out.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("n_out,n_in,rows", [(37, 45, 9), (70, 96, 600), (129, 201, 13), (16, 31, 64), (33, 2, 25)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_matmul_equals_the_float64_product_of_the_rounded_activations(n_out, n_in, rows, with_bias):
    """native/bf16_matmul.c on shapes that fill neither a group of sixteen outputs, a pass of
    twelve rows nor a pair of inputs; a build without AVX512-BF16 declines (the serving linear
    then widens the weight, test above)."""
    torch.manual_seed(n_out + n_in + rows)
    weight, reference = typed(torch.randn(n_out, n_in), BF16)
    x = torch.randn(rows, n_in)
    bias = torch.randn(n_out) if with_bias else None
    if not dense.bf16_matmul_available():
        with pytest.raises(ValueError, match="AVX512-BF16"):
            dense.bf16_matmul(x, weight, bias)
        return
    got = dense.bf16_matmul(x, weight, bias)
    want = x.bfloat16().double() @ reference.t() + (0 if bias is None else bias.double())
    assert got.shape == (rows, n_out) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)


def test_int4_weights_are_refused():
    """int4 prompts take integer_matmul; widening them is not this function's job."""
    weight, _ = typed(torch.randn(8, 32), Q4)
    with pytest.raises(ValueError, match="dense_matmul"):
        dense.dense_matmul(torch.randn(20, 32), weight)


def test_the_portable_build_gives_the_same_matmuls(monkeypatch):
    """ASTRAI_PORTABLE_KERNELS=1 builds the library for the generic target: the same numbers."""
    torch.manual_seed(6)
    weight, _ = typed(torch.randn(45, 100), Q8)
    x = torch.randn(30, 100)
    native = dense.dense_matmul(x, weight)
    monkeypatch.setenv("ASTRAI_PORTABLE_KERNELS", "1")
    kernels._library.cache_clear()
    try:
        portable = dense.dense_matmul(x, weight)
    finally:
        monkeypatch.delenv("ASTRAI_PORTABLE_KERNELS")
        kernels._library.cache_clear()
    assert torch.equal(portable, native)
