"""The engine's oneDNN-packed weight copies: same products, used for several rows without
autograd only, and packed again whenever the weight changes."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from astrai.inference import InferenceEngine, SamplingParams
from astrai.model.components import layers, packed_weights
from astrai.model.components.layers import Linear
from astrai.model.components.packed_weights import pack_linears, packed_weight, unpack_linears
from inference_helpers import greedy_reference, make_model

pytestmark = pytest.mark.skipif(not packed_weights.onednn_available(), reason="this PyTorch build has no oneDNN")


@pytest.fixture
def packed_rows(monkeypatch):
    """Row counts of the products computed from packed copies."""
    rows = []
    real = layers.packed_linear
    monkeypatch.setattr(layers, "packed_linear", lambda x, *a: rows.append(x.numel() // x.shape[-1]) or real(x, *a))
    return rows


def test_packed_products_match_the_plain_ones_and_skip_one_row_and_autograd(packed_rows):
    torch.manual_seed(0)
    for bias in (False, True):
        linear = Linear(64, 48, bias=bias)
        if bias:
            nn.init.normal_(linear.bias)
        assert pack_linears(linear) == 1 and pack_linears(linear) == 0  # packed once
        for shape in ((2, 1, 64), (4, 64), (1, 3, 64), (9, 1, 64), (1, 40, 64), (300, 64)):
            x = torch.randn(shape)
            with torch.no_grad():
                got = linear(x)
            assert got.shape == (*shape[:-1], 48)
            assert torch.allclose(got, nn.functional.linear(x, linear.weight, linear.bias), atol=1e-5)
    assert packed_rows == [2, 4, 3, 9, 40, 300] * 2
    packed_rows.clear()
    with torch.no_grad():
        linear(torch.randn(1, 1, 64))  # one row: the split or plain product streams the weight faster
        Linear(64, 48)(torch.randn(8, 64))  # never packed
    linear(torch.randn(8, 64, requires_grad=True)).sum().backward()  # training: autograd's product
    assert packed_rows == []


def test_a_changed_weight_is_packed_again_before_its_next_product(packed_rows):
    torch.manual_seed(0)
    linear = Linear(32, 16)
    pack_linears(linear)
    x = torch.randn(5, 32)

    def check():
        with torch.no_grad():
            assert torch.allclose(linear(x), x @ linear.weight.t(), atol=1e-5)

    check()
    first = packed_weight(linear.weight)
    with torch.no_grad():
        linear.weight.mul_(-2.0)  # in place, as an optimizer step or load_state_dict writes
    check()
    assert packed_weight(linear.weight) is not first
    linear.weight.data = torch.randn(16, 32)  # a new tensor under the same Parameter
    check()
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.5)
    linear(torch.randn(4, 32)).square().sum().backward()
    optimizer.step()
    check()
    assert len(packed_rows) == 4
    linear.to(torch.bfloat16)  # another dtype: no packed copy any more, the plain product
    packed_rows.clear()
    with torch.no_grad():
        got = linear(x.bfloat16())
    assert packed_rows == [] and packed_weight(linear.weight) is None
    want = x.bfloat16().float() @ linear.weight.float().t()
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_unpack_frees_the_copies(packed_rows):
    model = make_model("tiny")
    assert pack_linears(model) == len({id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)})
    assert packed_weight(model.lm_head.weight) is not None
    unpack_linears(model)
    assert packed_weight(model.lm_head.weight) is None
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert packed_rows == []


@pytest.mark.parametrize("kind", ["tiny", "tiny-mla", "tiny-moe"])
def test_engine_packs_by_default_and_follows_weight_updates(kind, packed_rows):
    model = make_model(kind)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(12)]
    expected = [greedy_reference(model, p, 8) for p in prompts]
    other = make_model(kind, seed=1)
    expected_after = [greedy_reference(other, p, 8) for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=12, page_size=4, num_pages=128, prefill_chunk_size=48) as engine:
        assert packed_weight(model.layers[0].attention.o_proj.weight) is not None
        handles = [engine.submit(p, params) for p in prompts]
        assert [h.result(timeout=60).token_ids for h in handles] == expected
        assert any(r > 1 for r in packed_rows)  # prefill chunks and multi-row decode steps
        packed_rows.clear()
        engine.update_weights(other)  # in-place copies: every packed copy is stale now
        handles = [engine.submit(p, params) for p in prompts]
        assert [h.result(timeout=60).token_ids for h in handles] == expected_after
        assert packed_rows
    unpack_linears(model)


def test_engine_without_packing_makes_no_copies():
    model = make_model("tiny")
    with InferenceEngine(model, None, max_batch_size=2, num_pages=32, pack_weights=False) as engine:
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0)).result(timeout=60)
    assert packed_weight(model.lm_head.weight) is None
