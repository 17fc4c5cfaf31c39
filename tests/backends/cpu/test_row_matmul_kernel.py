"""The C one-row GEMV (matmul): equal to F.linear for row-major weights (with rows further apart
than the inputs, any thread count, with and without bias), used by ``serving_linear`` for
exactly the single-row matmuls it serves, and by a single request's decode steps."""

from __future__ import annotations

import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.backends.cpu import serving
from astrai.backends.cpu.kernels import kernels_available, row_matmul, row_matmul_argmax
from inference_helpers import greedy_reference, make_model, padded_weight, with_threads


def test_the_kernels_build_on_this_machine():
    assert kernels_available()  # CI has a compiler; the fallback is tested separately


@pytest.mark.parametrize("n_out,n_in", [(64, 64), (96, 256), (1000, 48), (7, 5), (1, 1), (33, 3), (16, 130)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_row_matmul_equals_the_float64_product(n_out, n_in, threads, with_bias):
    torch.manual_seed(n_out * 7 + n_in)
    weight = padded_weight(n_out, n_in, spare=5)
    bias = torch.randn(n_out) if with_bias else None
    x = torch.randn(1, 1, n_in)
    got = with_threads(threads, lambda: row_matmul(x, weight, bias))
    want = x.double() @ weight.t().double() + (0 if bias is None else bias.double())
    assert got.shape == (1, 1, n_out)
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_of_the_gemv_is_torchs_first_maximum_and_first_nan(threads):
    """The head's GEMV (the C decode step's last) also returns torch.argmax of what it
    wrote: the first of tied maxima, even when they fall in different threads' stretches of
    rows, and the first NaN when there is one."""
    torch.manual_seed(threads)
    n_out, n_in = 101, 24
    weight = padded_weight(n_out, n_in, spare=3)
    x = torch.randn(n_in)
    y, best = with_threads(threads, lambda: row_matmul_argmax(x, weight))
    assert torch.allclose(y.double(), weight.double() @ x.double(), atol=1e-4)
    assert best == int(y.argmax())
    for tied in ([7, 40, 99], [60, 80], [3, 4]):  # the same largest row at several places
        w = weight.clone()
        w[tied] = 5 * x.sign()  # each of these rows scores 5 * sum(|x|), well above the others
        y, best = with_threads(threads, lambda: row_matmul_argmax(x, w))
        assert torch.equal(y[tied], y[tied[0]].expand(len(tied)))  # truly tied
        assert best == int(y.argmax()) == tied[0]
    for nans in ([70], [90, 20], [0, 100]):
        w = weight.clone()
        w[nans, 0] = float("nan")
        y, best = with_threads(threads, lambda: row_matmul_argmax(x, w))
        assert best == int(y.argmax()) == min(nans)
    with pytest.raises(ValueError, match="layout or dtype"):
        row_matmul_argmax(x, torch.randn(8, n_in).t())


def test_row_matmul_refuses_layouts_it_cannot_read():
    x = torch.randn(1, 8)
    with pytest.raises(ValueError, match="layout or dtype"):
        row_matmul(x, torch.randn(8, 4).t(), None)  # column-major
    with pytest.raises(ValueError, match="layout or dtype"):
        row_matmul(x, torch.randn(4, 16)[:, ::2], None)  # inputs not contiguous within a row
    with pytest.raises(ValueError, match="layout or dtype"):
        row_matmul(torch.randn(2, 8), torch.randn(4, 8), None)  # two rows
    with pytest.raises(ValueError, match="layout or dtype"):
        row_matmul(x.double(), torch.randn(4, 8).double(), None)


def test_linear_sends_only_single_rows_with_row_major_weights_to_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(serving, "row_matmul", lambda x, w, b: calls.append(x.shape) or x @ w.t())
    weight = torch.randn(16, 24)  # [16 out, 24 in], nn.Linear's layout
    with torch.no_grad():
        serving.serving_linear(torch.randn(1, 1, 24), weight, None, None)
        assert len(calls) == 1
        serving.serving_linear(torch.randn(1, 3, 24), weight, None, None)  # several rows: not the kernel
        serving.serving_linear(torch.randn(1, 1, 24), weight.t().contiguous().t(), None, None)  # column-major: not the kernel
    serving.serving_linear(torch.randn(1, 1, 24), weight, None, None)  # autograd on: not the kernel
    assert len(calls) == 1


def _single_request_outputs():
    model = make_model("tiny")
    prompts = [[5, 9, 200, 3], [17] * 11, [1]]
    expected = [greedy_reference(model, p, 12) for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=1, page_size=4, num_pages=64) as engine:
        got = [engine.submit(p, params).result(timeout=60).token_ids for p in prompts]
    return got, expected


def test_single_request_decode_runs_the_kernel_and_matches_recomputation(monkeypatch):
    """The model's own forward (the fused step, test_fused_decode.py, turned off)."""
    monkeypatch.setenv("ASTRAI_FUSED_DECODE", "0")
    calls = []
    real = serving.row_matmul
    monkeypatch.setattr(serving, "row_matmul", lambda x, w, b=None: calls.append(w.shape) or real(x, w, b))
    got, expected = _single_request_outputs()
    assert got == expected
    assert len(calls) > 3 * 11 * 5  # every decode step's matmuls (5 per layer + head at least)


def test_without_the_kernels_single_rows_take_the_split(monkeypatch):
    monkeypatch.setenv("ASTRAI_FUSED_DECODE", "0")
    monkeypatch.setattr(serving, "kernels_available", lambda: False)
    monkeypatch.setattr(serving, "row_matmul", lambda *a: pytest.fail("kernel called"))
    got, expected = _single_request_outputs()
    assert got == expected
