"""Building an InferenceEngine from a model object leaves that object exactly as it was: the
engine serves its own copy unless the caller consents to in-place preparation."""

from __future__ import annotations

import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams
from inference_helpers import make_model


def _state(model: torch.nn.Module) -> dict:
    """Everything about the model an engine could have changed."""
    params = {name: (p.untyped_storage().data_ptr(), p.data_ptr(), p.stride(), p.requires_grad, p.detach().clone())
              for name, p in model.named_parameters()}
    types = {name: type(m) for name, m in model.named_modules()}
    with torch.no_grad():
        logits = model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))["logits"]
    return {"params": params, "types": types, "training": model.training, "logits": logits}


@pytest.mark.parametrize("kind", ["tiny", "tiny-mla", "tiny-moe"])
def test_building_an_engine_changes_nothing_in_the_given_model(kind):
    model = make_model(kind, vocab_size=2048, dim=256, dim_ffn=1024)  # weights large enough for huge pages
    model.train()  # the engine serves in eval mode; the caller's flag must stay
    before = _state(model)
    with InferenceEngine(model, None, max_batch_size=2, page_size=4, num_pages=32) as engine:
        engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)).result(timeout=60)
        assert engine.model is not model
        after = _state(model)
    assert after["types"] == before["types"]
    assert after["training"] is True
    for name, (storage, address, stride, grad, values) in before["params"].items():
        got = after["params"][name]
        assert got[:4] == (storage, address, stride, grad), name
        assert torch.equal(got[4], values), name
    assert torch.equal(after["logits"], before["logits"])


def test_in_place_is_the_callers_explicit_choice():
    model = make_model("tiny")
    with InferenceEngine(model, None, num_pages=16, in_place=True) as engine:
        assert engine.model is model and not model.training


def test_an_unknown_setting_is_named():
    from astrai.errors import RequestError

    with pytest.raises(RequestError, match="pack_weights"):
        InferenceEngine(make_model("tiny"), None, pack_weights=False)
