"""Every entry point into the C kernels checks, in Python, each size, stride and dtype the C
code trusts: a bias shorter than the output, a weight narrower than ``in_features``, key and
value buffers of other batch, width or length than the query, a token or position past the
decode plan. C would read past the end of such a tensor and answer with whatever lies there."""

from __future__ import annotations

import pytest
import torch

from astrai.backends.cpu import dense_product as dense
from astrai.backends.cpu.kernels import (BF16, F32, Q4, Q8, Q41, TypedWeight, decode_attention, decode_step,
                                        decode_steps, kernels_available, row_product, rows_product, typed_product)
from astrai.model.quantized import quantize_weight
from inference_helpers import make_model
from test_fused_decode import _runner

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

BITS = {Q8: 8, Q4: 4, Q41: 4}
SHORT_BIASES = [torch.zeros(3), torch.zeros(9), torch.zeros(8, dtype=torch.float64), torch.zeros(16)[::2],
                torch.zeros(2, 4)]


def blocks(kind: int, n_out: int = 8, n_in: int = 64) -> TypedWeight:
    torch.manual_seed(0)
    weight = torch.randn(n_out, n_in)
    if kind in BITS:
        values, scales = quantize_weight(weight, BITS[kind], asymmetric=kind == Q41)
        return TypedWeight(values, scales, kind, n_in)
    return TypedWeight(weight.to(torch.bfloat16 if kind == BF16 else torch.float32), None, kind, n_in)


@pytest.mark.parametrize("bias", SHORT_BIASES, ids=["short", "long", "fp64", "strided", "2d"])
def test_every_product_refuses_a_bias_that_is_not_one_fp32_value_per_output(bias):
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="integer_product"):
        dense.integer_product(torch.randn(5, 64), blocks(Q4), bias)
    with pytest.raises(ValueError, match="dense_product"):
        dense.dense_product(torch.randn(5, 64), blocks(Q8), bias)
    with pytest.raises(ValueError, match="typed_product"):
        typed_product(x, blocks(Q8), bias)
    weight = torch.randn(8, 64)
    with pytest.raises(ValueError, match="row_product"):
        row_product(x, weight, bias)
    with pytest.raises(ValueError, match="rows_product"):
        rows_product(torch.randn(3, 64), weight, bias)


def test_a_right_bias_is_added():
    """The checks above refuse only what is wrong: the same calls with an fp32 bias of the output's length run."""
    bias = torch.arange(8.0)
    x = torch.randn(5, 64)
    plain = dense.integer_product(x, blocks(Q4))
    assert torch.allclose(dense.integer_product(x, blocks(Q4), bias), plain + bias, atol=1e-5)
    weight = torch.randn(8, 64)
    assert torch.allclose(row_product(x[0], weight, bias), row_product(x[0], weight) + bias, atol=1e-5)


@pytest.mark.parametrize("kind", [F32, BF16, Q8, Q4, Q41])
def test_a_weight_narrower_than_its_inputs_is_refused(kind):
    """A weight whose rows hold fewer than ``in_features`` inputs (32 of 64) would have the
    kernels read each row's tail from the next row, or past the last one."""
    narrow = blocks(kind, n_in=32)
    claimed = TypedWeight(narrow.data, narrow.scales, kind, 64)
    with pytest.raises(ValueError, match="typed weight"):
        claimed.check()
    with pytest.raises(ValueError, match="typed weight"):
        typed_product(torch.randn(1, 64), claimed)
    if kind in (Q4, Q41):
        with pytest.raises(ValueError, match="typed weight"):
            dense.integer_product(torch.randn(5, 64), claimed)
    if kind in (BF16, Q8):
        with pytest.raises(ValueError, match="typed weight"):
            dense.dense_product(torch.randn(5, 64), claimed)


@pytest.mark.parametrize("kind", [Q8, Q4, Q41])
def test_block_scales_that_do_not_cover_the_rows_are_refused(kind):
    weight = blocks(kind)
    for scales in (weight.scales[:4], weight.scales[:, :1], weight.scales.float(), weight.scales.t()):
        with pytest.raises(ValueError, match="typed weight"):
            TypedWeight(weight.data, scales, kind, 64).check()
    with pytest.raises(ValueError, match="typed weight"):
        TypedWeight(weight.data, None, kind, 64).check()


def test_weight_rows_must_be_contiguous_and_apart():
    weight = torch.randn(8, 64)
    with pytest.raises(ValueError, match="typed weight"):
        TypedWeight(weight.t().contiguous().t(), None, F32, 64).check()  # columns, not rows, contiguous
    with pytest.raises(ValueError, match="typed weight"):
        TypedWeight(torch.randn(100).as_strided((8, 64), (4, 1)), None, F32, 64).check()  # overlapping rows


def test_decode_attention_refuses_key_and_value_buffers_that_do_not_match_the_query():
    q, lens = torch.randn(2, 1, 4, 8), torch.tensor([3, 3])
    k, v = torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    decode_attention(q, k, v, lens, 1.0)  # the shapes that match
    for bad_k, bad_v in ((k[:1], v), (k, v[:1]), (k[..., :4], v), (k, v[:, :5]), (k, v[:, :, :1]), (k[:, :, :0], v)):
        with pytest.raises(ValueError, match="layout or dtype"):
            decode_attention(q, bad_k, bad_v, lens, 1.0)
    with pytest.raises(ValueError, match="layout or dtype"):
        decode_attention(torch.randn(2, 2, 4, 8), k, v, lens, 1.0)  # two queries a row
    with pytest.raises(ValueError, match="layout or dtype"):
        decode_attention(q, k, v, torch.tensor([3]), 1.0)


def test_the_decode_step_refuses_a_token_or_position_outside_its_plan():
    """The fused decode step reads the embedding's row ``token`` and rotary and buffer rows up to
    its last position: the kernel's own entry refuses what its plan has no row for."""
    runner = _runner(make_model("tiny"))
    assert runner.cache.task_alloc("a", [1, 2, 3, 4, 5])
    target = runner.decode_target("a", 3)
    assert runner.fused_decode.ready()
    plan = runner.fused_decode._checked_plan(5, target)
    vocab, capacity = plan.embedding_rows, plan.capacity
    offsets = (0, 0)
    decode_step(plan, 5, 3, offsets)
    for token, pos in ((vocab, 3), (-1, 3), (5, capacity), (5, -1)):
        with pytest.raises(ValueError, match="outside the plan"):
            decode_step(plan, token, pos, offsets)
    with pytest.raises(ValueError, match="outside the plan"):
        decode_steps(plan, 5, capacity - 1, [offsets, offsets], [], vocab)
    with pytest.raises(ValueError, match="outside the plan"):
        decode_steps(plan, 5, 3, [offsets], [], vocab + 1)
