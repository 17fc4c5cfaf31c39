"""The engine stores linear weights column-major (faster decode on CPU) without changing the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.weight_layout import use_column_major_linears
from astrai.model import AutoModel
from inference_helpers import greedy_reference, make_model


def _column_major(weight: torch.Tensor) -> bool:
    """[out, in] stored as the rows of an [in, >= out] matrix (q/k/v and gate/up share one)."""
    return weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0]


@pytest.fixture
def split_rows(monkeypatch):
    """Row counts of the products that took the two-half split, with a second thread pretended
    (the suite runs single-threaded, where the split is skipped)."""
    from astrai.model.components import layers

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    rows = []
    real_split = layers._split_product
    monkeypatch.setattr(layers, "_split_product", lambda x, *a: rows.append(x.numel() // x.shape[-1]) or real_split(x, *a))
    return rows


def test_relayout_keeps_parameters_values_and_ties():
    model = make_model("tiny")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    params = {name: p for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in params.items()}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        logits_before = model(ids)["logits"]
    assert not any(_column_major(m.weight) for m in linears)

    unique = {id(m.weight) for m in linears}
    assert use_column_major_linears(model) == len(unique)
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied: changed once, for both
    assert all(_column_major(m.weight) for m in linears)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], logits_before, atol=1e-5, rtol=1e-5)
    assert use_column_major_linears(model) == 0  # already done: nothing to change
    for dtype in (torch.float16, torch.bfloat16):  # only fp32 gains (fp16 products got 14x slower)
        other = make_model("tiny").to(dtype)
        assert use_column_major_linears(other) == 0
        assert not _column_major(other.lm_head.weight)


@pytest.mark.parametrize("kind", ["tiny", "tiny-mla", "tiny-moe"])
def test_engine_decodes_with_column_major_weights_and_keeps_them_on_update(kind, tmp_path, split_rows):
    """Without packed copies (``pack_weights=False``, or a build without oneDNN) every product of
    up to 64 rows takes the split; the outputs stay those of full recomputation."""
    import random

    from astrai.model.components import layers

    model = make_model(kind)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(12)]
    expected = [greedy_reference(model, p, 8) for p in prompts]
    fresh = {k: v.clone() for k, v in make_model(kind, seed=1).state_dict().items()}
    with InferenceEngine(model, None, max_batch_size=12, page_size=4, num_pages=128, prefill_chunk_size=48,
                         pack_weights=False) as engine:
        assert _column_major(model.lm_head.weight) and _column_major(model.layers[0].attention.q_proj.weight)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        handles = [engine.submit(p, params) for p in prompts]
        assert [h.result(timeout=60).token_ids for h in handles] == expected
        # both kinds of split ran: inner halves (up to 8 rows) and output halves (more rows)
        assert any(r <= layers.SPLIT_INNER_MAX_ROWS for r in split_rows)
        assert any(r > layers.SPLIT_INNER_MAX_ROWS for r in split_rows)
        engine.update_weights(fresh)
        assert _column_major(model.layers[0].mlp.down.weight)
        assert torch.equal(model.layers[0].mlp.down.weight, fresh["layers.0.mlp.down.weight"])
    model.save_pretrained(tmp_path)  # safetensors are written from contiguous copies
    reloaded = AutoModel.from_pretrained(tmp_path)
    for name, p in reloaded.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name


def test_few_row_products_of_column_major_weights_are_split_in_two(split_rows, monkeypatch):
    from astrai.model.components import layers
    from astrai.model.components.layers import Linear

    # one-row products take the C kernel when it is built (test_row_product_kernel.py); here, the split
    monkeypatch.setattr(layers, "kernels_available", lambda: False)
    torch.manual_seed(0)
    for bias in (False, True):
        linear = Linear(64, 48, bias=bias)
        if bias:
            nn.init.normal_(linear.bias)
        use_column_major_linears(linear)
        for shape in ((1, 1, 64), (2, 1, 64), (4, 64), (1, 3, 64), (9, 1, 64), (1, 40, 64), (64, 64)):
            x = torch.randn(shape)
            with torch.no_grad():
                got = linear(x)
            assert got.shape == (*shape[:-1], 48)
            assert torch.allclose(got, torch.nn.functional.linear(x, linear.weight, linear.bias), atol=1e-5)
    assert len(split_rows) == 14  # every one of them took the split path (inner halves up to 8 rows, outputs beyond)
    split_rows.clear()
    x = torch.randn(65, 64)  # more rows, gradients, or a row-major weight: the plain product
    with torch.no_grad():
        linear(x)
        Linear(64, 48)(torch.randn(1, 64))
    linear(torch.randn(1, 64, requires_grad=True)).sum().backward()
    assert split_rows == []


def test_lora_layers_and_their_merge_take_the_split_too(split_rows):
    from astrai.model.lora import LoraConfig, inject_lora, merge_lora

    model = make_model("tiny")
    inject_lora(model, LoraConfig(rank=4, alpha=8, targets=["q_proj", "down"]))
    for p in model.parameters():  # a trained adapter: B is no longer zero
        if p.requires_grad:
            nn.init.normal_(p, std=0.05)
    ids = torch.tensor([[5, 9, 2]])
    with torch.no_grad():
        want = model(ids)["logits"]
    use_column_major_linears(model)
    q_proj = model.layers[0].attention.q_proj
    assert _column_major(q_proj.weight) and not _column_major(q_proj.lora_A)
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], want, atol=1e-5)
    assert len(split_rows) == 2 * 7 + 1  # 7 base products per layer (LoRA ones included) and the head
    merge_lora(model)
    split_rows.clear()
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], want, atol=1e-4)
    assert len(split_rows) == 2 * 7 + 1  # merged layers are astrai's Linear again


def test_lookups_in_a_column_major_table_match_the_row_major_ones(monkeypatch):
    from astrai.model.components.layers import Embedding

    torch.manual_seed(0)
    table = Embedding(50, 8)
    want = {shape: torch.randint(0, 50, shape) for shape in ((1,), (3, 1), (2, 5), (4, 1, 2))}
    rows = {shape: torch.nn.functional.embedding(ids, table.weight).detach() for shape, ids in want.items()}
    with torch.no_grad():
        table.weight.data = table.weight.data.t().contiguous().t()
    transposed = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a: transposed.append(self.shape) or real(self, *a))
    for shape, ids in want.items():
        with torch.no_grad():
            got = table(ids)
        assert got.shape == (*shape, 8) and torch.equal(got, rows[shape])
    assert transposed == [(8, 50)] * len(want)  # read through the [dim, vocab] transpose
    got = table(want[(2, 5)])  # with autograd: the usual lookup, and its gradient
    got.sum().backward()
    assert torch.equal(got.detach(), rows[(2, 5)]) and table.weight.grad is not None
