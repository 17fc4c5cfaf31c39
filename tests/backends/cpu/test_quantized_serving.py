"""Serving int8, int4 and bf16 weights on the CPU (serving.py's dequantizing matmuls, the fused C step
over typed weights): greedy tokens equal those of the plain model under the same weights, one
request and a batch, every architecture option takes a fast path and the engine's stats say
which, and the forced portable build gives the same tokens."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch

from astrai.backends.cpu import kernels
from astrai.backends.cpu.kernels import kernels_available
from astrai.backends.cpu.serving import (InterleavedQuantizedLinear, prepare_for_serving,
                                         kernel_counts)
from astrai.inference import InferenceEngine, SamplingParams
from astrai.model.quantized import quantize_activations, quantize_model
from inference_helpers import greedy_reference, make_model, with_uneven_norms

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 200, 3], [17] * 11, [1, 2]]


def served(weights: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny model with uneven norms and random biases (where it has them) in ``weights``."""
    model = with_uneven_norms(make_model("tiny", seed=seed, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    if weights == "bf16":
        return model.to(torch.bfloat16)
    return quantize_model(model, weights) if weights != "fp32" else model


def run(model, prompts, max_batch_size=1):
    """Each prompt's greedy tokens from an engine over ``model``, and the engine's decode paths."""
    with InferenceEngine(model, None, max_batch_size=max_batch_size, page_size=4, num_pages=96) as engine:
        with engine.scheduler._lock:  # all queued before the loop plans a step: they decode together
            handles = [engine.submit(p, GREEDY) for p in prompts]
        tokens = [h.result(timeout=60).token_ids for h in handles]
        return tokens, engine.get_stats()["decode_paths"]


@pytest.mark.parametrize("weights", ["int8", "int4", "int4-asym", "bf16"])
@pytest.mark.parametrize("tied", [True, False])
def test_greedy_tokens_equal_the_plain_model_under_the_same_weights(weights, tied):
    """One request at a time (the fused step where it fits) and all three together (a few rows
    in one dequantizing matmul) give the tokens of the model's own forward, recomputed."""
    model = served(weights, tie_weight=tied)
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in PROMPTS]
    alone, paths = run(model, PROMPTS)
    steps = len(PROMPTS) * (GREEDY.max_tokens - 1)
    # an all-bf16 model keeps bf16 activations and KV cache, which the fused step does not take
    assert paths == ({"fused": steps, "row_kernels": 0, "batched": 0, "torch": 0} if weights != "bf16"
                     else {"fused": 0, "row_kernels": steps, "batched": 0, "torch": 0})
    together, paths = run(model, PROMPTS, max_batch_size=3)
    assert alone == together == want
    assert paths["torch"] == 0 and paths["row_kernels"] > 0


@pytest.mark.parametrize("overrides", [dict(), dict(attn_bias=True), dict(use_qk_norm=True),
                                       dict(attn_bias=True, use_qk_norm=True, tie_weight=False, vocab_size=1000)])
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_llama_qwen2_and_qwen3_shapes_decode_fused_and_the_stats_say_so(overrides, weights):
    """A plain llama, q/k/v biases (qwen2), QK-norm (qwen3), both with an untied head over a
    larger vocabulary: each single request's decode steps run fused, a batch's in the row
    kernels, none in plain torch, and the tokens are the model's own."""
    model = served(weights, **overrides)
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in PROMPTS[:2]]
    alone, paths = run(model, PROMPTS[:2])
    assert alone == want
    assert paths == {"fused": 2 * (GREEDY.max_tokens - 1), "row_kernels": 0, "batched": 0, "torch": 0}
    together, paths = run(model, PROMPTS[:2], max_batch_size=2)
    assert together == want and paths["torch"] == 0
    # a batch's few rows take the C kernels, fp32 (rows_matmul) and typed alike
    assert paths["row_kernels"] > 0 and paths["batched"] == 0


def test_bf16_linear_weights_under_fp32_activations_decode_fused():
    """Linear weights in bf16 with embedding, norms and KV cache in fp32 (llama.cpp's BF16): the
    fused step reads the bf16 weights and gives the tokens of the fp32 model holding the same
    values."""
    reference = served("fp32", tie_weight=False)
    model = served("fp32", tie_weight=False)
    with torch.no_grad():
        for module in list(model.modules()):
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.to(torch.bfloat16)
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.to(torch.bfloat16).float()
    want = [greedy_reference(reference, p, GREEDY.max_tokens) for p in PROMPTS]
    got, paths = run(model, PROMPTS)
    assert got == want
    assert paths == {"fused": len(PROMPTS) * (GREEDY.max_tokens - 1), "row_kernels": 0, "batched": 0, "torch": 0}


def test_a_batch_of_more_rows_than_one_pass_takes_stays_in_the_kernels():
    """Twelve rows: two passes of the dequantizing matmul over each weight, the tokens the model's own."""
    model = served("int8", seed=1)
    prompts = [[3 + i, 7, 11 * i % 256] for i in range(12)]
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in prompts]
    got, paths = run(model, prompts, max_batch_size=12)
    assert got == want
    assert paths["torch"] == 0 and paths["row_kernels"] >= GREEDY.max_tokens - 1


def test_a_model_the_fast_paths_do_not_fit_is_counted_as_torch(monkeypatch):
    monkeypatch.setenv("ASTRAI_NATIVE_KERNELS", "0")
    kernels._library.cache_clear()
    try:
        _, paths = run(served("int8"), PROMPTS[:1])
    finally:
        monkeypatch.delenv("ASTRAI_NATIVE_KERNELS")
        kernels._library.cache_clear()
    assert paths == {"fused": 0, "row_kernels": 0, "batched": 0, "torch": GREEDY.max_tokens - 1}


@pytest.mark.parametrize("weights,kernel", [("int4", "kernel"), ("bf16", "dense")])
def test_a_prefill_multiplies_the_dequantized_weight_once_per_matmul(weights, kernel):
    """Many rows take the integer matmul over int4 blocks (the "kernel" tally: no dequantizing matmul
    takes 37 rows) or the matmul over the widened weight ("dense"; bf16 activations in fp32
    where the CPU has no bf16 matmuls); its logits are the model's own."""
    model = served(weights)
    with InferenceEngine(model, None, page_size=4, num_pages=32) as engine:
        served_model = engine.model
        if weights == "int4":
            assert any(type(m) is InterleavedQuantizedLinear for m in served_model.modules())
        ids = torch.tensor([list(range(3, 40))])
        before = kernel_counts()[kernel]
        with torch.no_grad():
            got = served_model(ids)["logits"].float()
            want = model(ids)["logits"].float()
        assert kernel_counts()[kernel] > before
        if weights == "int4":
            # the integer sums add in another order than torch's float matmul: equal to about
            # 1e-6, except where that moves an activation of a later layer across a rounding
            # boundary of its Q8_0 block (one step of d, a few 1e-4 in the logits)
            close = (got - want).abs().amax(dim=-1) < 1e-5
            assert close.float().mean() > 0.9 and torch.allclose(got, want, atol=2e-3, rtol=0)
        else:
            assert torch.allclose(got, want, atol=3e-2, rtol=3e-2)  # bf16 logits: rounding of the last bit


def test_a_deep_copy_of_a_served_model_reads_its_own_weights():
    """A served module remembers its checked weight; a copy of it must not read the original's."""
    model = served("int8")
    prepare_for_serving(model)
    x = torch.randn(1, 1, 64)
    module = model.layers[0].attention.o_proj
    with torch.no_grad():
        module(x)  # checked once
        copy = deepcopy(module)
        # zero weights in the model's layout (a served module keeps its own layout: int8 may be
        # stored as w + 128, interleaved), loaded into the copy's own tensors
        copy.load_state_dict({name: torch.zeros_like(t) for name, t in copy.state_dict().items()})
        assert torch.equal(copy(x), torch.zeros(1, 1, 64)) and not torch.equal(module(x), copy(x))


def test_scales_assigned_anew_after_preparation_are_followed():
    """A stacked group whose member's scales were replaced runs module by module, with the new ones."""
    model = served("int8")
    prepare_for_serving(model)
    attention = model.layers[0].attention
    x = torch.randn(1, 1, 64)
    assert attention.joint.current() is not None
    attention.k_proj.scales = attention.k_proj.scales * 2
    assert attention.joint.current() is None
    with torch.no_grad():
        _, k, _ = attention.project(x)
        want = torch.nn.functional.linear(quantize_activations(x), attention.k_proj.dequantize())
        assert torch.allclose(k, want, atol=1e-5)


@pytest.mark.parametrize("weights", ["int4", "int4-asym"])
def test_the_portable_build_gives_the_same_tokens(weights, monkeypatch):
    model = served(weights)
    native, _ = run(model, PROMPTS)
    monkeypatch.setenv("ASTRAI_PORTABLE_KERNELS", "1")
    kernels._library.cache_clear()
    try:
        assert not kernels.dequant_matmul_vectorised()
        portable, paths = run(model, PROMPTS)
    finally:
        monkeypatch.delenv("ASTRAI_PORTABLE_KERNELS")
        kernels._library.cache_clear()
    assert portable == native and paths["fused"] > 0
