"""How the CPU runner prepares its model (astrai/backends/cpu/serving.py): stacked groups,
serving modules and packed copies keep values, names and ties, and every kernel of
``serving_linear`` equals ``F.linear``; engines decode with them exactly, before and after
a weight update, and a LoRA layer swapped in later is honoured."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from astrai.backends.cpu import serving
from astrai.backends.cpu.serving import (PackedWeight, ServingGQA, ServingLinear, ServingMLA, ServingMLP,
                                         prepare_for_serving, serving_linear)
from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import AutoModel
from astrai.model.components.layers import Linear
from inference_helpers import greedy_reference, make_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def kernels(monkeypatch):
    """Row counts of the matmuls that took the few-rows kernel, the packed copy and the
    two-half split, with a second thread pretended (the suite runs single-threaded, where the
    split is skipped)."""
    seen = {"rows": [], "packed": [], "split": []}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    real_rows = serving.rows_matmul
    monkeypatch.setattr(serving, "rows_matmul",
                        lambda x, *a: seen["rows"].append(x.numel() // x.shape[-1]) or real_rows(x, *a))
    real_split = serving._split_matmul
    monkeypatch.setattr(serving, "_split_matmul",
                        lambda x, *a: seen["split"].append(x.numel() // x.shape[-1]) or real_split(x, *a))
    real_packed = torch.ops.mkldnn._linear_pointwise

    class Ops:  # torch.ops.mkldnn seen through a counter
        @staticmethod
        def _linear_pointwise(x, *a):
            seen["packed"].append(x.numel() // x.shape[-1])
            return real_packed(x, *a)

        _reorder_linear_weight = staticmethod(torch.ops.mkldnn._reorder_linear_weight)

    monkeypatch.setattr(serving.torch.ops, "mkldnn", Ops, raising=False)
    return seen


def test_preparation_keeps_parameters_values_and_ties():
    model = make_model("tiny", vocab_size=2048, dim=256, dim_ffn=1024)
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        want = model(ids)["logits"]
    prepare_for_serving(model)
    assert dict(model.named_parameters()) == params  # the same Parameter objects, names and ties
    assert model.lm_head.weight is model.embed_tokens.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert all(type(layer.attention) is ServingGQA and type(layer.mlp) is ServingMLP for layer in model.layers)
    assert type(model.lm_head) is ServingLinear and type(model.layers[0].attention.o_proj) is ServingLinear
    for layer in model.layers:  # each group is one buffer, its weights row blocks of it in order
        joint = layer.attention.joint.current()
        assert joint is not None and joint.is_contiguous()
        assert joint.data_ptr() == layer.attention.q_proj.weight.data_ptr()
        assert layer.mlp.joint.current().shape == (2 * 1024, 256)
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], want, atol=1e-5, rtol=1e-5)
    other = make_model("tiny").to(torch.float16)  # the kernels read fp32, bf16 and quantized weights only
    prepare_for_serving(other)
    assert type(other.layers[0].attention).__name__ == "GQA" and type(other.lm_head) is Linear


def test_every_kernel_of_the_serving_linear_equals_f_linear(kernels, monkeypatch):
    torch.manual_seed(0)
    for bias in (False, True):
        weight, b = torch.randn(48, 64), (torch.randn(48) if bias else None)
        packed = PackedWeight(weight, [weight]) if serving.onednn_available() else None
        for shape in ((1, 1, 64), (2, 1, 64), (4, 64), (1, 40, 64), (300, 64)):
            x = torch.randn(shape)
            for copy in (packed, None):
                with torch.no_grad():
                    got = serving_linear(x, weight, b, copy)
                assert torch.allclose(got, nn.functional.linear(x, weight, b), atol=1e-5), (shape, copy)
    assert kernels["rows"] == [2, 2, 4, 4] * 2  # 2 to MAX_F32_ROWS rows stream the plain weight, copy or not
    if serving.onednn_available():
        assert kernels["packed"] == [40, 300] * 2  # more rows read the packed copy
    assert kernels["split"] == [40] * 2  # no packed copy: up to 64 rows take the split
    kernels["split"].clear()
    monkeypatch.setattr(serving, "kernels_available", lambda: False)
    with torch.no_grad():
        serving_linear(torch.randn(1, 64), torch.randn(48, 64), None, None)  # one row without the kernel: split
        serving_linear(torch.randn(65, 64), torch.randn(48, 64), None, None)  # more rows: the plain matmul
        serving_linear(torch.randn(1, 64), torch.randn(47, 64), None, None)  # odd outputs have no halves
    serving_linear(torch.randn(2, 64, requires_grad=True), torch.randn(48, 64), None, None)  # autograd: plain
    assert kernels["split"] == [1]


@pytest.mark.skipif(not serving.onednn_available(), reason="this PyTorch build has no oneDNN")
def test_a_changed_weight_is_packed_again_before_its_next_matmul():
    weight = torch.randn(16, 32)
    packed = PackedWeight(weight, [weight])
    x = torch.randn(5, 32)

    def check():
        with torch.no_grad():
            assert torch.allclose(serving_linear(x, weight, None, packed), x @ weight.t(), atol=1e-5)

    check()
    first = packed.get()
    assert packed.get() is first  # unchanged: the same copy
    weight.mul_(-2.0)  # in place, as update_weights' load_state_dict writes
    check()
    assert packed.get() is not first


@pytest.mark.parametrize("kind", ["tiny", "tiny-mla", "tiny-moe"])
@pytest.mark.parametrize("packing", [True, False])
def test_engine_decodes_exactly_and_keeps_its_layout_through_updates(kind, packing, kernels, monkeypatch, tmp_path):
    if packing and not serving.onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    monkeypatch.setattr(serving, "onednn_available", lambda: packing)
    model = make_model(kind)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(12)]
    expected = [greedy_reference(model, p, 8) for p in prompts]
    other = make_model(kind, seed=1)
    expected_after = [greedy_reference(other, p, 8) for p in prompts]
    with InferenceEngine(model, None, max_batch_size=12, page_size=4, num_pages=128, prefill_chunk_size=48) as engine:
        served = engine.model
        assert type(served.layers[0].mlp) in (ServingMLP, type(model.layers[0].mlp))  # MoE: its experts are
        if kind == "tiny-mla":
            assert type(served.layers[0].attention) is ServingMLA
        joint = served.layers[0].attention.joint.current()
        got = [h.result(timeout=60).token_ids for h in [engine.submit(p, GREEDY) for p in prompts]]
        assert got == expected
        assert any(r > 1 for r in kernels["packed" if packing else "split"])  # batched steps took that kernel
        engine.update_weights(other)  # copied in place: the layout stays, stale packed copies are redone
        assert served.layers[0].attention.joint.current() is joint
        got = [h.result(timeout=60).token_ids for h in [engine.submit(p, GREEDY) for p in prompts]]
        assert got == expected_after
    served.save_pretrained(tmp_path)  # a served model still saves and loads as the plain model
    reloaded = AutoModel.from_pretrained(tmp_path)
    for name, p in reloaded.state_dict().items():
        assert torch.equal(p, other.state_dict()[name]), name


def test_a_lora_layer_swapped_into_a_stacked_group_is_honoured():
    from astrai.model.lora import LoraConfig, inject_lora

    model = make_model("tiny")
    prepare_for_serving(model)
    inject_lora(model, LoraConfig(rank=4, alpha=8, targets=["q_proj", "up"]))
    for p in model.parameters():  # a trained adapter: B is no longer zero
        if p.requires_grad:
            nn.init.normal_(p, std=0.05)
    plain = make_model("tiny")
    inject_lora(plain, LoraConfig(rank=4, alpha=8, targets=["q_proj", "up"]))
    plain.load_state_dict(model.state_dict())
    ids = torch.tensor([[5, 9, 2]])
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], plain(ids)["logits"], atol=1e-5)
