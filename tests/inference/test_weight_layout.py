"""The engine stores linear weights column-major (faster decode on CPU) without changing the model."""

from __future__ import annotations

import torch
from torch import nn

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.weight_layout import use_column_major_linears
from astrai.model import AutoModel
from inference_helpers import greedy_reference, make_model


def _column_major(weight: torch.Tensor) -> bool:
    return weight.stride() == (1, weight.shape[0])


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


def test_engine_decodes_with_column_major_weights_and_keeps_them_on_update(tmp_path):
    model = make_model("tiny")
    prompt = [7, 3, 9, 1, 4]
    expected = greedy_reference(model, prompt, 10)
    fresh = {k: v.clone() for k, v in make_model("tiny", seed=1).state_dict().items()}
    with InferenceEngine(model, None, max_batch_size=2, page_size=4, num_pages=32) as engine:
        assert _column_major(model.lm_head.weight) and _column_major(model.layers[0].attention.q_proj.weight)
        got = engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)).result().token_ids
        assert got == expected
        engine.update_weights(fresh)
        assert _column_major(model.layers[0].mlp.down.weight)
        assert torch.equal(model.layers[0].mlp.down.weight, fresh["layers.0.mlp.down.weight"])
    model.save_pretrained(tmp_path)  # safetensors are written from contiguous copies
    reloaded = AutoModel.from_pretrained(tmp_path)
    for name, p in reloaded.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name
