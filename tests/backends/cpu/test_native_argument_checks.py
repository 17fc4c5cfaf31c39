"""Every entry point into the C kernels checks, in Python, each size, stride and dtype the C
code trusts: a bias shorter than the output, a weight narrower than ``in_features`` or of
another layout, key and value buffers of other batch, width or length than the query, a
token or position past the decode plan, a plan's tables of the wrong shape. C would read
past the end of such a tensor and answer with whatever lies there. Each check here was
removed in turn (a hand mutation pass) to see a test fail."""

from __future__ import annotations

import pytest
import torch

from astrai.backends.cpu import dense_matmul as dense
from astrai.backends.cpu.kernels import (BF16, COLUMNS, F32, Q4, Q8, Q41, TypedWeight, decode_attention, decode_plan,
                                        decode_step, decode_steps, kernels_available, rounded_activations, row_major,
                                        row_matmul, row_matmul_argmax, rows_matmul, dequant_matmul)
from astrai.model.quantized import quantize_activations, quantize_weight
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
def test_every_matmul_refuses_a_bias_that_is_not_one_fp32_value_per_output(bias):
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="integer_matmul"):
        dense.integer_matmul(torch.randn(5, 64), blocks(Q4), bias)
    with pytest.raises(ValueError, match="dense_matmul"):
        dense.dense_matmul(torch.randn(5, 64), blocks(Q8), bias)
    with pytest.raises(ValueError, match="dequant_matmul"):
        dequant_matmul(x, blocks(Q8), bias)
    weight = torch.randn(8, 64)
    with pytest.raises(ValueError, match="row_matmul"):
        row_matmul(x, weight, bias)
    with pytest.raises(ValueError, match="rows_matmul"):
        rows_matmul(torch.randn(3, 64), weight, bias)


def test_a_right_bias_is_added():
    """The checks above refuse only what is wrong: the same calls with an fp32 bias of the output's length run."""
    bias = torch.arange(8.0)
    x = torch.randn(5, 64)
    plain = dense.integer_matmul(x, blocks(Q4))
    assert torch.allclose(dense.integer_matmul(x, blocks(Q4), bias), plain + bias, atol=1e-5)
    weight = torch.randn(8, 64)
    assert torch.allclose(row_matmul(x[0], weight, bias), row_matmul(x[0], weight) + bias, atol=1e-5)


@pytest.mark.parametrize("kind", [F32, BF16, Q8, Q4, Q41])
def test_a_weight_narrower_than_its_inputs_is_refused(kind):
    """A weight whose rows hold fewer than ``in_features`` inputs (32 of 64) would have the
    kernels read each row's tail from the next row, or past the last one."""
    narrow = blocks(kind, n_in=32)
    claimed = TypedWeight(narrow.data, narrow.scales, kind, 64)
    with pytest.raises(ValueError, match="typed weight"):
        claimed.check()
    with pytest.raises(ValueError, match="typed weight"):
        dequant_matmul(torch.randn(1, 64), claimed)
    if kind in (Q4, Q41):
        with pytest.raises(ValueError, match="typed weight"):
            dense.integer_matmul(torch.randn(5, 64), claimed)
    if kind in (BF16, Q8):
        with pytest.raises(ValueError, match="typed weight"):
            dense.dense_matmul(torch.randn(5, 64), claimed)


@pytest.mark.parametrize("kind", [Q8, Q4, Q41])
def test_block_scales_that_do_not_cover_the_rows_are_refused(kind):
    weight = blocks(kind)
    for scales in (weight.scales[:4], weight.scales[:, :1], weight.scales.float(), weight.scales.t()):
        with pytest.raises(ValueError, match="typed weight"):
            TypedWeight(weight.data, scales, kind, 64).check()
    with pytest.raises(ValueError, match="typed weight"):
        TypedWeight(weight.data, None, kind, 64).check()


OVERLAPPING = torch.randn(100).as_strided((8, 64), (4, 1))  # each row starts 4 values after the last
SKIPPING = torch.randn(8, 128)[:, ::2]  # rows apart, but every other value of them


def test_weight_rows_must_be_contiguous_and_apart():
    weight = torch.randn(8, 64)
    for data in (weight.t().contiguous().t(), OVERLAPPING, SKIPPING, weight[None], weight[0]):
        with pytest.raises(ValueError, match="typed weight"):
            TypedWeight(data, None, F32, 64).check()
    with pytest.raises(ValueError, match="typed weight"):
        TypedWeight(weight, None, 7, 64).check()  # no such type
    x = torch.randn(64)
    for data in (OVERLAPPING, SKIPPING, weight.t().contiguous().t()):
        with pytest.raises(ValueError, match="row_matmul"):
            row_matmul(x, data)
        with pytest.raises(ValueError, match="row_matmul"):
            row_matmul_argmax(x, data)
        with pytest.raises(ValueError, match="rows_matmul"):
            rows_matmul(torch.randn(3, 64), data)
    assert not row_major(torch.randn(2, 3, 4)) and not row_major(torch.randn(4)) and row_major(weight)


@pytest.mark.parametrize("kind", [Q8, Q4, Q41])
def test_block_scales_of_another_shape_or_layout_are_refused(kind):
    weight = blocks(kind)
    spread = torch.zeros(weight.scales.shape[0], 2 * weight.scales.shape[1], dtype=torch.float16)[:, ::2]
    for scales in (weight.scales[..., None], weight.scales.reshape(-1), spread):
        with pytest.raises(ValueError, match="typed weight"):
            TypedWeight(weight.data, scales, kind, 64).check()


def test_dequant_matmul_refuses_rows_it_cannot_read():
    weight = blocks(Q8)
    for x in (torch.randn(1, 128)[:, ::2], torch.randn(2, 32), torch.randn(0, 64)):
        with pytest.raises(ValueError, match="dequant_matmul"):
            dequant_matmul(x, weight)
    with pytest.raises(ValueError, match="row_matmul"):
        row_matmul(torch.randn(128)[::2], torch.randn(8, 64))


def test_prompt_matmuls_refuse_rows_of_another_dtype_or_width():
    for x in (torch.randn(5, 64).double(), torch.randn(5, 32), torch.randn(5, 64).bfloat16()):
        with pytest.raises(ValueError, match="integer_matmul"):
            dense.integer_matmul(x, blocks(Q4))
        with pytest.raises(ValueError, match="dense_matmul"):
            dense.dense_matmul(x, blocks(Q8))


def test_rounded_activations_leaves_what_c_cannot_read_to_torch():
    """The native rounding reads contiguous fp32 only; anything else takes torch's, with the same numbers."""
    x = torch.randn(3, 70)
    for other in (x.double(), torch.randn(3, 140)[:, ::2]):
        assert torch.equal(rounded_activations(other), quantize_activations(other))


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
        decode_attention(torch.randn(2, 1, 4, 16)[..., ::2], k, v, lens, 1.0)  # q not contiguous
    for strided in (torch.randn(2, 10, 2, 16)[..., ::2],):
        with pytest.raises(ValueError, match="layout or dtype"):
            decode_attention(q, strided, v, lens, 1.0)
        with pytest.raises(ValueError, match="layout or dtype"):
            decode_attention(q, k, strided, lens, 1.0)
    with pytest.raises(ValueError, match="layout or dtype"):  # 4 query heads do not share 3 key heads
        decode_attention(q, torch.randn(2, 10, 3, 8), torch.randn(2, 10, 3, 8), lens, 1.0)
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


def plan_parts(vocab=16, dim=64, heads=4, kv_heads=2, head_dim=16, ffn=96, capacity=8):
    """decode_plan's arguments for a model of those sizes (the plan reads none of their values)."""
    return dict(embedding=torch.randn(vocab, dim), layers=torch.zeros(2, COLUMNS, dtype=torch.int64),
                dims=(dim, heads, kv_heads, head_dim, ffn), cos=torch.randn(capacity, head_dim),
                sin=torch.randn(capacity, head_dim), capacity=capacity, eps=1e-5, scale=0.25,
                final_norm=torch.ones(dim), head=TypedWeight(torch.randn(vocab, dim), None, F32, dim), threads=2)


@pytest.mark.parametrize("change", [
    dict(cos=torch.randn(7, 16)), dict(sin=torch.randn(8, 8)), dict(cos=torch.randn(16, 8).t()),
    dict(layers=torch.zeros(2, COLUMNS)), dict(layers=torch.zeros(2, COLUMNS - 1, dtype=torch.int64)),
    dict(layers=torch.zeros(COLUMNS, 2, dtype=torch.int64).t()),
    dict(head=TypedWeight(torch.randn(16, 32), None, F32, 32)), dict(embedding=torch.randn(16, 64).double()),
    dict(head=TypedWeight(torch.randn(16, 32), None, F32, 64))],
    ids=["cos-rows", "sin-width", "cos-layout", "table-dtype", "table-width", "table-layout", "head-width",
         "embedding-dtype", "head-narrow"])
def test_a_decode_plan_of_the_wrong_shapes_is_refused(change):
    decode_plan(**plan_parts())
    with pytest.raises(ValueError, match="decode_plan|typed weight"):
        decode_plan(**{**plan_parts(), **change})
