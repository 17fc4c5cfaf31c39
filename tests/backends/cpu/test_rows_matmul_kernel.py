"""The C matmul of a few rows by an fp32 weight (continuous batching's decode steps): equal
to F.linear for every row count up to the serving limit and beyond, with rows of the
weight further apart than its inputs, any thread count, with and without bias; chosen by
``serving_linear`` for 2 to ``MAX_F32_ROWS`` rows only; the same in the portable build;
and a batch's decode steps give the model's own tokens through it."""

from __future__ import annotations

import pytest
import torch

from astrai.backends.cpu import kernels, serving
from astrai.backends.cpu.kernels import MAX_F32_ROWS, rows_matmul
from astrai.inference import InferenceEngine, SamplingParams
from inference_helpers import greedy_reference, make_model, padded_weight, with_threads


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 21])
@pytest.mark.parametrize("n_out,n_in", [(64, 64), (33, 130), (7, 5), (1, 1), (200, 17)])
@pytest.mark.parametrize("threads", [1, 3])
def test_rows_matmul_equals_the_float64_product(rows, n_out, n_in, threads):
    torch.manual_seed(rows * 100 + n_out + n_in)
    weight = padded_weight(n_out, n_in, spare=3)
    bias = torch.randn(n_out) if rows % 2 else None
    x = torch.randn(rows, n_in)
    got = with_threads(threads, lambda: rows_matmul(x, weight, bias))
    want = x.double() @ weight.t().double() + (0 if bias is None else bias.double())
    assert got.shape == (rows, n_out)
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)


def test_rows_matmul_keeps_leading_dimensions_and_refuses_what_it_cannot_read():
    weight = torch.randn(6, 8)
    x = torch.randn(2, 3, 8)
    assert torch.allclose(rows_matmul(x, weight), x @ weight.t(), atol=1e-5)
    for bad_x, bad_w in ((x, weight.t().contiguous().t()),            # column-major weight
                         (torch.randn(8, 3).t(), weight),              # rows not contiguous
                         (x.double(), weight.double()),                # not fp32
                         (torch.randn(2, 7), weight)):                 # wrong input width
        with pytest.raises(ValueError, match="layout or dtype"):
            rows_matmul(bad_x, bad_w)
    with pytest.raises(ValueError, match="layout or dtype"):
        rows_matmul(x, weight, torch.randn(5))  # bias of the wrong size


def test_serving_sends_two_to_max_rows_to_the_rows_kernel(monkeypatch):
    calls = []
    real = serving.rows_matmul
    monkeypatch.setattr(serving, "rows_matmul", lambda x, w, b=None: calls.append(x.shape) or real(x, w, b))
    weight = torch.randn(16, 24)
    with torch.no_grad():
        for rows in (1, 2, MAX_F32_ROWS, MAX_F32_ROWS + 1, 64):
            x = torch.randn(rows, 24)
            assert torch.allclose(serving.serving_linear(x, weight, None, None), x @ weight.t(), atol=1e-5)
    assert [shape[0] for shape in calls] == [2, MAX_F32_ROWS]
    serving.serving_linear(torch.randn(3, 24), weight, None, None)  # autograd on: plain torch
    assert len(calls) == 2


def test_the_portable_build_gives_the_same_matmuls(monkeypatch):
    """ASTRAI_PORTABLE_KERNELS=1: plain C loops instead of AVX2, the same matmuls (up to the
    order of the additions)."""
    torch.manual_seed(3)
    weight, x, bias = padded_weight(45, 100, spare=2), torch.randn(11, 100), torch.randn(45)
    native = rows_matmul(x, weight, bias)
    monkeypatch.setenv("ASTRAI_PORTABLE_KERNELS", "1")
    kernels._library.cache_clear()
    try:
        portable = rows_matmul(x, weight, bias)
    finally:
        monkeypatch.delenv("ASTRAI_PORTABLE_KERNELS")
        kernels._library.cache_clear()
    assert torch.allclose(portable, native, atol=1e-4, rtol=1e-5)


def test_a_batch_decodes_through_the_rows_kernel_with_the_models_own_tokens(monkeypatch):
    calls = []
    real = serving.rows_matmul
    monkeypatch.setattr(serving, "rows_matmul", lambda x, w, b=None: calls.append(x.shape) or real(x, w, b))
    model = make_model("tiny")
    prompts = [[5, 9, 200, 3], [17] * 11, [1], [40, 41, 42]]
    expected = [greedy_reference(model, p, 10) for p in prompts]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=4, page_size=4, num_pages=64) as engine:
        handles = [engine.submit(p, params) for p in prompts]
        got = [h.result(timeout=60).token_ids for h in handles]
        paths = engine.get_stats()["decode_paths"]
    assert got == expected
    assert len(calls) > 9 * 4  # every batched decode step's matmuls
    assert paths["row_kernels"] > 0 and paths["batched"] == paths["torch"] == 0
