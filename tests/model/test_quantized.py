"""Weight-only int8/int4: GGUF's Q8_0/Q4_0/Q4_1 numbers, bounded round-trip error, matmuls
against a float reference on odd shapes, and quantize_model's choice of layers."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from astrai.config import preset
from astrai.errors import ConfigError
from astrai.model import AutoModel
from astrai.model.quantized import (QuantizedLinear, dequantize_weight, quantize_activations, quantize_model,
                                    quantize_weight)

GGUF_TYPES = {8: Q.Q8_0, 4: Q.Q4_0}


def gguf_blocks(qweight: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Our (qweight, scales) laid out as GGUF blocks: an fp16 scale, then the block's bytes."""
    out, groups = scales.shape
    d = scales.numpy().view(np.uint8).reshape(out, groups, 2)
    q = qweight.numpy().view(np.uint8).reshape(out, groups, -1)
    return np.concatenate([d, q], axis=-1).reshape(out, -1)


def awkward_weight(out: int, in_: int, seed: int = 0) -> torch.Tensor:
    """Random weights with the edge cases: an all-zero block, ties at the block maximum, halves."""
    w = torch.randn(out, in_, generator=torch.Generator().manual_seed(seed))
    w[0, :32] = 0
    if out > 1 and in_ >= 8:
        w[1, :8] = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, 0.25, -0.25, 0.0])
    return w


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_equal_gguf(bits):
    w = awkward_weight(7, 96)
    qweight, scales = quantize_weight(w, bits)
    ours = gguf_blocks(qweight, scales)
    theirs = gguf_quantize(w.numpy(), GGUF_TYPES[bits])
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(dequantize_weight(qweight, scales, bits, 96).numpy(),
                                  gguf_dequantize(theirs, GGUF_TYPES[bits]))


# in steps of the block's largest magnitude / (127 or 8): int8 rounds to half a step, int4 clamps
# the largest value of the other sign to +7 steps (one step off); fp16 scales add up to 127 (8) × 2^-11 steps
@pytest.mark.parametrize("bits,step,steps", [(8, 1 / 127, 0.5 + 127 / 2048), (4, 1 / 8, 1 + 8 / 2048)])
@pytest.mark.parametrize("in_features", [1, 31, 33, 100])
def test_round_trip_error_is_bounded_per_block(bits, step, steps, in_features):
    """Each element is off by at most its share of a step; padding is zero."""
    w = awkward_weight(5, in_features, seed=in_features)
    qweight, scales = quantize_weight(w, bits)
    padded = -(-in_features // 32) * 32
    assert scales.shape == (5, padded // 32) and scales.dtype == torch.float16
    assert qweight.shape == ((5, padded) if bits == 8 else (5, padded // 2))
    back = dequantize_weight(qweight, scales, bits, in_features)
    assert back.shape == w.shape
    padded_w = torch.nn.functional.pad(w, (0, padded - in_features)).reshape(5, -1, 32)
    block_max = padded_w.abs().amax(-1, keepdim=True).expand_as(padded_w).reshape(5, padded)[:, :in_features]
    assert ((back - w).abs() <= block_max * step * steps * (1 + 1e-5)).all()
    full = dequantize_weight(qweight, scales, bits, padded)
    assert (full[:, in_features:] == 0).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out_features,in_features", [(1, 45), (13, 45), (64, 32), (3, 200)])
@pytest.mark.parametrize("rows", [1, 9])
def test_matmuls_equal_float_reference(bits, out_features, in_features, rows):
    torch.manual_seed(out_features * in_features + rows + bits)
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    module = QuantizedLinear.from_linear(linear, bits)
    x = torch.randn(2, rows, in_features)
    multiplied = quantize_activations(x)  # int8 and int4 multiply Q8_0-rounded activations
    reference = multiplied @ module.dequantize().T + linear.bias.detach()
    torch.testing.assert_close(module(x), reference, rtol=1e-5, atol=1e-5)
    float_error = (module(x) - linear(x)).abs().max() / linear(x).abs().max()
    # int8 rounds weights and activations to 127 steps of their blocks (at most 0.021 over 300 seeds here)
    assert float_error < (0.04 if bits == 8 else 0.3)


@pytest.mark.parametrize("shape", [(45,), (3, 32), (2, 5, 100)])
def test_quantize_activations_rounds_each_block_to_127_steps_once(shape):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * torch.logspace(-4, 3, shape[-1])
    x[..., :3] = 0.0
    rounded = quantize_activations(x)
    assert rounded.shape == x.shape and rounded.dtype == x.dtype
    assert torch.equal(quantize_activations(rounded), rounded)  # idempotent: the kernels may round again
    padded = torch.nn.functional.pad(x, (0, -shape[-1] % 32)).reshape(*shape[:-1], -1, 32)
    step = (padded.abs().amax(-1, keepdim=True) / 127).expand_as(padded).reshape(*shape[:-1], -1)[..., :shape[-1]]
    assert ((rounded - x).abs() <= step * (0.5 + 127 / 2048)).all()  # half a step, and 127 times the fp16 scale's error
    assert (rounded[..., :3] == 0).all() and torch.equal(quantize_activations(torch.zeros(4, 40)), torch.zeros(4, 40))


def test_cast_keeps_the_format():
    module = QuantizedLinear.from_linear(torch.nn.Linear(40, 6, bias=True), 4)
    scales, qweight = module.scales.clone(), module.qweight.clone()
    module.to(torch.bfloat16)
    assert module.scales.dtype == torch.float16 and torch.equal(module.scales, scales)
    assert module.qweight.dtype == torch.uint8 and torch.equal(module.qweight, qweight)
    assert module.bias.dtype == torch.float32
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    assert module(x).dtype == torch.bfloat16


def tiny_model(**overrides):
    torch.manual_seed(0)
    return AutoModel.from_config(preset("tiny", vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                        dim_ffn=80, **overrides)).eval()


def test_quantize_model_replaces_block_linears_and_head():
    model = tiny_model(tie_weight=True)
    quantize_model(model, "int4")
    kinds = {name: (m.bits if isinstance(m, QuantizedLinear) else None)
             for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))}
    assert kinds["lm_head"] == 8
    assert all(bits == 4 for name, bits in kinds.items() if name.startswith("layers."))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.config.tie_weight is True  # the head's int8 blocks are the one table
    assert torch.equal(model.embed_tokens.weight, model.lm_head.dequantize())
    assert model.quantization == {"format": "int4", "group_size": 32}


def test_unknown_format_is_refused():
    with pytest.raises(ConfigError, match="int8, int4"):
        quantize_model(tiny_model(), "int3")


def test_quantized_model_logits_follow_the_float_model():
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        reference = model(ids)["logits"]
        quantize_model(model, "int8")
        logits = model(ids)["logits"]
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()


def q4_1_blocks(qweight: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Our Q4_1 (qweight, scales [d's | minimums]) laid out as GGUF blocks: d, m, then the nibbles."""
    out = qweight.shape[0]
    groups = scales.shape[1] // 2
    d = scales[:, :groups].contiguous().numpy().view(np.uint8).reshape(out, groups, 2)
    m = scales[:, groups:].contiguous().numpy().view(np.uint8).reshape(out, groups, 2)
    q = qweight.numpy().view(np.uint8).reshape(out, groups, -1)
    return np.concatenate([d, m, q], axis=-1).reshape(out, -1)


def test_asymmetric_int4_bytes_equal_gguf_q4_1():
    w = awkward_weight(7, 96) + 0.3  # off-centre blocks, where a minimum pays
    qweight, scales = quantize_weight(w, 4, asymmetric=True)
    assert qweight.dtype == torch.uint8 and scales.shape == (7, 2 * 3)
    theirs = gguf_quantize(w.numpy(), Q.Q4_1)
    np.testing.assert_array_equal(q4_1_blocks(qweight, scales), theirs)
    np.testing.assert_array_equal(dequantize_weight(qweight, scales, 4, 96).numpy(), gguf_dequantize(theirs, Q.Q4_1))


@pytest.mark.parametrize("in_features", [1, 31, 33, 100])
def test_asymmetric_round_trip_error_is_half_a_step_of_the_blocks_range(in_features):
    """Each element is off by at most half of (max - min) / 15 of its block (plus fp16 rounding
    of d and the minimum), however far the block sits from zero."""
    w = awkward_weight(5, in_features, seed=in_features) * 0.1 + 5.0
    qweight, scales = quantize_weight(w, 4, asymmetric=True)
    back = dequantize_weight(qweight, scales, 4, in_features)
    padded = -(-in_features // 32) * 32
    blocks = torch.nn.functional.pad(w, (0, padded - in_features)).reshape(5, -1, 32)
    spread = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)).expand_as(blocks)
    bound = spread.reshape(5, padded)[:, :in_features] / 15 * (0.5 + 15 / 2048) + 5.0 / 2048
    assert ((back - w).abs() <= bound).all()
    if in_features >= 32:  # a whole block off centre (a short one is padded with zeros, which widen its range)
        symmetric = dequantize_weight(*quantize_weight(w, 4), 4, in_features)
        assert (back - w).abs().mean() < (symmetric - w).abs().mean() / 4  # there a minimum pays


@pytest.mark.parametrize("out_features,in_features", [(1, 45), (13, 45), (64, 32)])
def test_asymmetric_matmuls_equal_float_reference(out_features, in_features):
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    module = QuantizedLinear.from_linear(linear, 4, asymmetric=True)
    assert module.asymmetric and "asymmetric" in repr(module)
    x = torch.randn(2, 3, in_features)
    reference = quantize_activations(x) @ module.dequantize().T + linear.bias.detach()
    torch.testing.assert_close(module(x), reference, rtol=1e-5, atol=1e-5)


def test_asymmetric_is_int4_only_and_not_calibrated():
    linear = torch.nn.Linear(64, 8)
    with pytest.raises(ConfigError, match="only int4"):
        quantize_weight(linear.weight, 8, asymmetric=True)
    with pytest.raises(ConfigError, match="symmetric form"):
        QuantizedLinear.from_linear(linear, 4, importance=torch.ones(64), asymmetric=True)
    model = AutoModel.from_config(preset("tiny", vocab_size=64, n_layers=1))
    with pytest.raises(ConfigError, match="symmetric form"):
        quantize_model(model, "int4-asym", importance={})
    quantize_model(model, "int4-asym")
    assert model.quantization["format"] == "int4-asym"
    assert model.layers[0].mlp.up.asymmetric and model.lm_head.bits == 8
