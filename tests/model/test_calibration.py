"""Calibrated int4: Q4_0-layout blocks whose scales follow the activations' importance."""

import pytest
import torch

from astrai.config import preset
from astrai.model import AutoModel
from astrai.model.calibration import activation_importance
from astrai.model.int4_scales import quantize_int4_weighted
from astrai.model.quantized import dequantize_weight, quantize_weight


def weighted_error(w, back, importance):
    return ((w - back) ** 2 * importance).sum().item()


@pytest.mark.parametrize("in_features", [32, 45, 96])
def test_weighted_scales_lower_the_weighted_error_of_q4_0(in_features):
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(24, in_features, generator=g)
    importance = torch.rand(in_features, generator=g) ** 4 * 10  # a few loud channels
    plain = dequantize_weight(*quantize_weight(w, 4), 4, in_features)
    qweight, scales = quantize_int4_weighted(w, importance)
    assert qweight.dtype == torch.uint8 and scales.dtype == torch.float16
    assert qweight.shape == (24, -(-in_features // 32) * 16) and scales.shape == (24, -(-in_features // 32))
    calibrated = dequantize_weight(qweight, scales, 4, in_features)
    assert weighted_error(w, calibrated, importance) < 0.9 * weighted_error(w, plain, importance)
    # still 4-bit values: every weight is a level in [-8, 7] times its block's scale
    levels = calibrated.reshape(24, -1) / scales.float().repeat_interleave(32, 1)[:, :in_features]
    finite = levels[scales.float().repeat_interleave(32, 1)[:, :in_features] != 0]
    assert torch.equal(finite, finite.round()) and finite.min() >= -8 and finite.max() <= 7


def test_zero_blocks_and_zero_importance_stay_finite():
    w = torch.randn(3, 64)
    w[0] = 0
    importance = torch.zeros(64)
    qweight, scales = quantize_int4_weighted(w, importance)
    back = dequantize_weight(qweight, scales, 4, 64)
    assert torch.isfinite(back).all() and torch.equal(back[0], torch.zeros(64))
    assert (back[1:] - w[1:]).abs().max() < w[1:].abs().max() / 4


def test_importance_shape_is_checked():
    with pytest.raises(ValueError, match="importance has shape"):
        quantize_int4_weighted(torch.randn(4, 64), torch.ones(63))


def test_activation_importance_is_the_mean_square_input_of_each_linear():
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", vocab_size=64, n_layers=2)).eval()
    name = "layers.1.mlp.down"
    seen = []
    handle = model.get_submodule(name).register_forward_hook(lambda m, i, o: seen.append(i[0].reshape(-1, i[0].shape[-1])))
    ids = torch.randint(0, 64, (40,)).tolist()
    importance = activation_importance(model, ids, [name, "layers.0.attention.q_proj"], window=16)
    handle.remove()
    inputs = torch.cat(seen)
    assert inputs.shape[0] == 40  # three windows: 16 + 16 + 8 tokens
    torch.testing.assert_close(importance[name], (inputs ** 2).mean(0))
    assert set(importance) == {name, "layers.0.attention.q_proj"}
