"""Serving lets go of the weight file: after ``prepare_for_serving`` no tensor views the mapped
safetensors file, so the mapping (every page read while loading) leaves the process's memory."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
from inference_helpers import make_model

from astrai.backends.cpu.serving import prepare_for_serving
from astrai.model import AutoModel
from astrai.model.quantized import cast_linear_weights, quantize_model
from astrai.model.weight_files import file_mappings, release_weight_file

CONVERSIONS = {
    "fp32": lambda model: model,
    "bf16": lambda model: cast_linear_weights(model, torch.bfloat16),
    "int8": lambda model: quantize_model(model, "int8"),
}


def _mapped(path: Path) -> bool:
    return any(line.rstrip().endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


def _in_a_file(model: torch.nn.Module) -> list[str]:
    ranges = file_mappings()
    return [name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if any(low <= tensor.untyped_storage().data_ptr() < high for low, high in ranges)]


@pytest.mark.parametrize("precision", sorted(CONVERSIONS))
def test_served_model_holds_no_view_of_the_weight_file(tmp_path, precision):
    make_model("tiny").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    ids = torch.randint(0, 100, (1, 12))
    reference = copy.deepcopy(CONVERSIONS[precision](AutoModel.from_pretrained(tmp_path).eval()))
    prepare_for_serving(reference)  # a copy in memory of its own, served the same way
    with torch.no_grad():
        expected = reference(ids)["logits"]
    del reference
    gc.collect()

    model = CONVERSIONS[precision](AutoModel.from_pretrained(tmp_path).eval())
    assert _in_a_file(model), "loading assigns views of the mapped file (the premise of this test)"
    assert _mapped(weights)
    prepare_for_serving(model)
    assert _in_a_file(model) == []
    gc.collect()
    assert not _mapped(weights), "a tensor somewhere still keeps the weight file mapped"
    with torch.no_grad():
        torch.testing.assert_close(model(ids)["logits"], expected)


def test_shared_tensors_stay_shared(tmp_path):
    make_model("tiny", tie_weight=True).save_pretrained(tmp_path)
    model = AutoModel.from_pretrained(tmp_path).eval()
    assert model.lm_head.weight is model.embed_tokens.weight
    copied = release_weight_file(model)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert copied >= model.embed_tokens.weight.nbytes  # the shared table counted (and copied) once at least
    assert _in_a_file(model) == []
