"""Q4_0 and Q8_0 weights served eight rows interleaved (interleaved.py, the kernels' Q4X8 and
Q8X8): the layout round-trips, the dequantizing and integer matmuls over it give the model
layout's numbers, the kernels refuse what they cannot read, and prepare_for_serving lays a
model's Q4_0 (and, on a CPU with VNNI, Q8_0) linears out so while its state dict, its
dequantized weights and a state dict loaded into it stay the model's."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch

from astrai.backends.cpu.dense_matmul import integer_int8_available, integer_matmul
from astrai.backends.cpu.interleaved import (can_interleave, interleaved_scales, interleaved_values, model_scales,
                                             model_values)
from astrai.backends.cpu.kernels import Q4, Q4X8, Q8, Q8X8, TypedWeight, dequant_matmul, kernels_available
from astrai.backends.cpu.serving import InterleavedQuantizedLinear, ServingMLP, prepare_for_serving
from astrai.model.quantized import dequantize_weight, quantize_activations, quantize_model, quantize_weight
from inference_helpers import make_model

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

KINDS = {4: (Q4, Q4X8), 8: (Q8, Q8X8)}


def both_layouts(n_out: int, n_in: int, bits: int, seed: int = 0):
    """The same random Q4_0 or Q8_0 weight as the model lays it out and interleaved, and the
    float64 weight."""
    torch.manual_seed(seed)
    values, scales = quantize_weight(torch.randn(n_out, n_in), bits)
    plain, mixed = KINDS[bits]
    model = TypedWeight(values, scales, plain, n_in)
    interleaved = TypedWeight(interleaved_values(values), interleaved_scales(scales), mixed, n_in)
    return model, interleaved, dequantize_weight(values, scales, bits, n_in).double()


@pytest.mark.parametrize("bits", [4, 8])
def test_interleaving_round_trips_and_keeps_each_groups_bytes_in_the_group(bits):
    values, scales = quantize_weight(torch.randn(24, 96), bits)
    assert can_interleave(values, scales)
    mixed, mixed_scales = interleaved_values(values), interleaved_scales(scales)
    assert mixed.shape == values.shape and mixed.dtype == values.dtype and mixed_scales.shape == scales.shape
    assert not torch.equal(mixed, values)
    assert torch.equal(model_values(mixed), values) and torch.equal(model_scales(mixed_scales), scales)
    stored = mixed.view(torch.uint8) ^ (0x80 if bits == 8 else 0)  # Q8_0's bytes are kept as w + 128
    for g in range(3):  # the bytes of rows 8g..8g+7 stay among those rows
        rows = slice(8 * g, 8 * g + 8)
        assert torch.equal(stored[rows].flatten().sort().values, values[rows].view(torch.uint8).flatten().sort().values)
    # block 1's second four bytes of row 2 sit at 32 k + 4 i in the block's bytes (k = 1, i = 2)
    block = 16 if bits == 4 else 32
    start = 8 * block + 32 + 8
    assert torch.equal(stored[:8].flatten()[start:start + 4], values[2, block + 4:block + 8].view(torch.uint8))
    assert torch.equal(mixed_scales[:8].flatten()[8:16], scales[:8, 1])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n_out,n_in", [(8, 32), (16, 45), (40, 200), (64, 576)])
def test_the_interleaved_matmuls_give_the_model_layouts_numbers(n_out, n_in, bits, monkeypatch):
    """One to eight rows (the dequantizing matmul, threads splitting the groups unevenly) equal
    the float64 product with the dequantized weight; many rows (the integer matmul, which
    reads the same bytes) equal the model layout's integer matmul bit for bit."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    model, interleaved, reference = both_layouts(n_out, n_in, bits, seed=n_out + n_in)
    bias = torch.randn(n_out)
    for rows in range(1, 9):
        x = torch.randn(rows, n_in)
        want = torch.nn.functional.linear(quantize_activations(x).double(), reference, bias.double())
        got = dequant_matmul(x, interleaved, bias)
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5), rows
        alone = torch.cat([dequant_matmul(x[r:r + 1].contiguous(), interleaved, bias) for r in range(rows)])
        assert torch.equal(got, alone)
    if bits == 8 and not integer_int8_available():
        return
    for rows in (1, 9, 30):
        x = torch.randn(rows, n_in)
        assert torch.equal(integer_matmul(x, interleaved, bias), integer_matmul(x, model, bias))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernels_refuse_an_interleaved_weight_they_cannot_read(bits):
    _, interleaved, _ = both_layouts(16, 64, bits)
    x = torch.randn(1, 64)
    cut = TypedWeight(interleaved.data[:12], interleaved.scales[:12], interleaved.kind, 64)  # not whole groups
    width = interleaved.data.shape[1]
    wide = torch.zeros(16, width + 8, dtype=interleaved.data.dtype)
    wide[:, :width] = interleaved.data
    spread = TypedWeight(wide[:, :width], interleaved.scales, interleaved.kind, 64)  # rows further apart
    for weight in (cut, spread):
        with pytest.raises(ValueError, match="unsupported layout"):
            dequant_matmul(x, weight)
        with pytest.raises(ValueError):
            integer_matmul(torch.randn(9, 64), weight)
    assert not can_interleave(interleaved.data[:12], interleaved.scales[:12])


@pytest.mark.parametrize("format", ["int4", "int8"])
def test_serving_interleaves_q4_0_and_q8_0_linears_and_keeps_the_model_state(format):
    model = quantize_model(make_model("tiny", seed=4), format)
    served = deepcopy(model)
    prepare_for_serving(served)
    interleaved = {name for name, m in served.named_modules() if type(m) is InterleavedQuantizedLinear}
    bits = 4 if format == "int4" else 8
    if bits == 8 and not integer_int8_available():  # Q8_0 stays as it is without VNNI
        assert not interleaved
        return
    matching = {name for name, m in model.named_modules() if getattr(m, "bits", None) == bits}
    assert interleaved >= matching and matching
    joints = [m.joint for m in served.modules() if isinstance(m, ServingMLP)]
    assert joints and all(joint.typed_weight().kind == KINDS[bits][1] for joint in joints)
    state, want = served.state_dict(), model.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    originals = dict(model.named_modules())
    with torch.no_grad():
        for name in interleaved:
            module, original = dict(served.named_modules())[name], originals[name]
            assert torch.equal(module.dequantize(), original.dequantize())
            for rows in (1, 5, 12):  # the dequantizing matmul, then the integer one
                x = torch.randn(rows, module.in_features)
                assert torch.allclose(module(x), original(x), atol=1e-4, rtol=1e-4), (name, rows)


def test_a_state_dict_loaded_into_a_served_model_is_interleaved_again():
    """update_weights loads the model's layout into the served one: its outputs must then be
    those of the new weights, through the stacked groups too."""
    served = quantize_model(make_model("tiny", seed=4), "int4")
    prepare_for_serving(served)
    other = quantize_model(make_model("tiny", seed=9), "int4")
    served.load_state_dict(other.state_dict())
    state = served.state_dict()
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())
    with torch.no_grad():
        mlp, want = served.layers[0].mlp, other.layers[0].mlp
        x = torch.randn(3, mlp.gate.in_features)
        for got, expected in zip(mlp.project(x), (want.gate(x), want.up(x))):
            assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_asymmetric_int4_keeps_its_layout():
    served = quantize_model(make_model("tiny", seed=4), "int4-asym")
    prepare_for_serving(served)
    assert not any(type(m) is InterleavedQuantizedLinear and m.bits == 4 for m in served.modules())


def test_an_interleaved_int8_weight_without_the_integer_matmul_takes_the_other_paths(monkeypatch):
    """A library without VNNI loaded after preparation (a test forcing a level): many rows of an
    interleaved int8 weight go through the dequantizing matmul's passes or torch, not an
    integer matmul that cannot read them. Preparation is told VNNI is there, so that the
    weight is interleaved on any CPU."""
    from astrai.backends.cpu import dense_matmul, serving

    model = quantize_model(make_model("tiny", seed=4), "int8")
    served = deepcopy(model)
    monkeypatch.setattr(serving, "integer_int8_available", lambda: True)
    prepare_for_serving(served)
    module, original = served.layers[0].mlp.down, model.layers[0].mlp.down
    assert type(module) is InterleavedQuantizedLinear
    for module_with_check in (serving, dense_matmul):
        monkeypatch.setattr(module_with_check, "integer_int8_available", lambda: False)
    with torch.no_grad():
        for rows in (12, 20):
            x = torch.randn(rows, module.in_features)
            assert torch.allclose(module(x), original(x), atol=1e-4, rtol=1e-4), rows
