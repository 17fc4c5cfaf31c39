"""The engine stacks joint linears and moves large weights into huge pages without changing the
model; products of a few rows are split in two halves when no faster path is at hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from astrai.huge_pages import HUGE_PAGE_BYTES
from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.weight_layout import lay_out_linears
from astrai.model import AutoModel
from astrai.model.components.joint_weights import joint_groups, joint_weight
from inference_helpers import greedy_reference, make_model


def _stacked(model) -> list[bool]:
    return [joint_weight([m.weight for m in group]) is not None for group in joint_groups(model)]


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


def test_layout_keeps_parameters_values_and_ties():
    model = make_model("tiny")
    params = {name: p for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in params.items()}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        logits_before = model(ids)["logits"]
    assert not any(_stacked(model))

    grouped = sum(len(group) for group in joint_groups(model))
    assert grouped == 5 * len(model.layers)  # q/k/v and gate/up; every other weight is under 2 MiB here
    assert lay_out_linears(model) == grouped
    assert all(_stacked(model))
    assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, nn.Linear))  # still row-major
    assert model.lm_head.weight is model.embed_tokens.weight
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], logits_before, atol=1e-5, rtol=1e-5)
    assert lay_out_linears(model) == 0  # already done: nothing to change
    for dtype in (torch.float16, torch.bfloat16):  # the kernels and packed copies are fp32 only
        other = make_model("tiny").to(dtype)
        assert lay_out_linears(other) == 0 and not any(_stacked(other))


def test_a_large_weight_moves_once_and_a_shared_one_once_for_both(monkeypatch):
    # the tied table (2048 x 256 floats) is 2 MiB: it moves, once, for the embedding and the head
    model = make_model("tiny", vocab_size=2048, dim=256, dim_ffn=1024)
    table = model.embed_tokens.weight
    assert table.nbytes >= HUGE_PAGE_BYTES and model.lm_head.weight is table
    address, values = table.data_ptr(), table.detach().clone()
    grouped = sum(len(group) for group in joint_groups(model))
    assert lay_out_linears(model) == grouped + 1
    assert table.data_ptr() != address and torch.equal(table, values) and table.is_contiguous()
    assert lay_out_linears(model) == 0
    monkeypatch.setenv("ASTRAI_HUGE_PAGES", "0")  # without huge pages only the groups are stacked
    model = make_model("tiny", vocab_size=2048, dim=256, dim_ffn=1024)
    address = model.embed_tokens.weight.data_ptr()
    assert lay_out_linears(model) == grouped and model.embed_tokens.weight.data_ptr() == address


@pytest.mark.parametrize("kind", ["tiny", "tiny-mla", "tiny-moe"])
def test_engine_decodes_with_laid_out_weights_and_keeps_them_on_update(kind, tmp_path, split_rows):
    """Without packed copies (``pack_weights=False``, or a build without oneDNN) every product of
    two to 64 rows takes the split; the outputs stay those of full recomputation."""
    import random

    model = make_model(kind)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(12)]
    expected = [greedy_reference(model, p, 8) for p in prompts]
    fresh = {k: v.clone() for k, v in make_model(kind, seed=1).state_dict().items()}
    with InferenceEngine(model, None, max_batch_size=12, page_size=4, num_pages=128, prefill_chunk_size=48,
                         pack_weights=False) as engine:
        assert all(_stacked(model))
        split_rows.clear()
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        handles = [engine.submit(p, params) for p in prompts]
        assert [h.result(timeout=60).token_ids for h in handles] == expected
        assert any(r > 1 for r in split_rows)  # batched decode steps and short prefills took the split
        engine.update_weights(fresh)
        assert all(_stacked(model))
        assert torch.equal(model.layers[0].mlp.up.weight, fresh["layers.0.mlp.up.weight"])
    model.save_pretrained(tmp_path)  # safetensors are written from contiguous copies
    reloaded = AutoModel.from_pretrained(tmp_path)
    for name, p in reloaded.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name


def test_few_row_products_are_split_in_two(split_rows, monkeypatch):
    from astrai.model.components import layers
    from astrai.model.components.layers import Linear

    # one-row products take the C kernel when it is built (test_row_product_kernel.py); here, the split
    monkeypatch.setattr(layers, "kernels_available", lambda: False)
    torch.manual_seed(0)
    for bias in (False, True):
        linear = Linear(64, 48, bias=bias)
        if bias:
            nn.init.normal_(linear.bias)
        for shape in ((1, 1, 64), (2, 1, 64), (4, 64), (1, 3, 64), (9, 1, 64), (1, 40, 64), (64, 64)):
            x = torch.randn(shape)
            with torch.no_grad():
                got = linear(x)
            assert got.shape == (*shape[:-1], 48)
            assert torch.allclose(got, torch.nn.functional.linear(x, linear.weight, linear.bias), atol=1e-5)
    assert split_rows == [1, 2, 4, 3, 9, 40, 64] * 2  # every one of them took the split path
    split_rows.clear()
    with torch.no_grad():
        linear(torch.randn(65, 64))  # more rows: the plain product
        Linear(64, 47)(torch.randn(1, 64))  # an odd number of outputs has no halves
        odd = Linear(64, 48)
        odd.weight.data = odd.weight.data.t().contiguous().t()  # not contiguous: no view of two halves
        odd(torch.randn(1, 64))
    linear(torch.randn(1, 64, requires_grad=True)).sum().backward()  # gradients: the plain product
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
    lay_out_linears(model)
    split_rows.clear()
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], want, atol=1e-5)
    assert len(split_rows) == 2 * 7 + 1  # 7 base products per layer (LoRA ones included) and the head
    merge_lora(model)
    split_rows.clear()
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], want, atol=1e-4)
    assert len(split_rows) == 2 * 7 + 1  # merged layers are astrai's Linear again
