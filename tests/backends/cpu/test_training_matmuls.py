"""fp32 training matmuls through oneDNN (astrai/backends/cpu/training.py): same values and
gradients as ``F.linear``, taken only where they should be, chosen by measuring this CPU, and
switched on for a model only within ``fast_training_matmuls``, which also installs the fused
loss's matmuls (oneDNN's matmul for the head, a bf16 projection only where this CPU's pays)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.config import preset
from astrai.model import AutoModel
from astrai.backends.cpu import training as onednn_linear
from astrai.backends.cpu.training import OneDnnLinear, fast_training_matmuls, training_linear
from astrai.model.components import linear_cross_entropy as lce
from astrai.model.components.layers import Linear

pytestmark = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                     and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
                                reason="this PyTorch build has no oneDNN linear")


@pytest.fixture
def onednn_calls(monkeypatch):
    """Force the oneDNN path on and count its matmuls."""
    calls = []
    real = onednn_linear.onednn_matmul

    def counting(x, weight, bias=None):
        calls.append((tuple(x.shape), tuple(weight.shape)))
        return real(x, weight, bias)

    monkeypatch.setattr(onednn_linear, "onednn_matmul", counting)
    monkeypatch.setattr(onednn_linear, "onednn_fp32_pays", lambda: True)
    monkeypatch.setattr(onednn_linear, "onednn_weight_grad_pays", lambda: True)
    return calls


@pytest.mark.parametrize("weight_grad_pays", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_f_linear(onednn_calls, monkeypatch, with_bias, weight_grad_pays):
    monkeypatch.setattr(onednn_linear, "onednn_weight_grad_pays", lambda: weight_grad_pays)
    torch.manual_seed(0)
    x = torch.randn(5, 3, 40).transpose(0, 1).requires_grad_()  # [3, 5, 40], not contiguous
    weight = torch.randn(24, 40, requires_grad=True)
    bias = torch.randn(24, requires_grad=True) if with_bias else None
    grad_out = torch.randn(24, 5, 3).permute(2, 1, 0)  # not contiguous either
    inputs = (x, weight) + ((bias,) if with_bias else ())

    got = training_linear(x, weight, bias)
    got_grads = torch.autograd.grad(got, inputs, grad_out)
    # the forward matmul and, in backward, the input's gradient, and the weight's where that pays
    assert len(onednn_calls) == (3 if weight_grad_pays else 2)
    if weight_grad_pays:
        assert onednn_calls[-1] == ((24, 15), (40, 15))  # gradᵀ @ x: both operands transposed views
    want = F.linear(x, weight, bias)
    want_grads = torch.autograd.grad(want, inputs, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_frozen_weight_gets_no_gradient_and_input_still_does(onednn_calls):
    torch.manual_seed(1)
    x = torch.randn(7, 16, requires_grad=True)
    weight = torch.randn(12, 16)  # frozen (a LoRA base weight)
    out = training_linear(x, weight)
    (grad_x,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad_x, torch.ones(7, 12) @ weight)
    assert weight.grad is None and onednn_calls


def test_only_fp32_matmuls_with_autograd_take_onednn(onednn_calls):
    x, weight = torch.randn(6, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    with torch.no_grad():
        training_linear(x, weight)  # inference keeps its own paths
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert training_linear(x, weight).dtype == torch.bfloat16  # autocast's bf16 matmul
    training_linear(x.double(), weight.double())
    assert onednn_calls == []
    training_linear(x, weight)
    assert onednn_calls == [((6, 16), (8, 16))]


def test_without_the_measured_gain_training_keeps_f_linear(onednn_calls, monkeypatch):
    monkeypatch.setattr(onednn_linear, "onednn_fp32_pays", lambda: False)
    x, weight = torch.randn(6, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    training_linear(x, weight).sum().backward()
    assert onednn_calls == []


def test_a_training_step_matches_the_mkl_one(onednn_calls, monkeypatch):
    """The whole model's loss and every parameter's gradient, with the vocabulary
    projection's forward matmul on oneDNN too."""
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                         dim_ffn=128, max_len=64))
    ids = torch.randint(0, 300, (2, 33))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], target_ids=ids[:, 1:])["loss"]
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = step()
    assert onednn_calls == []  # not opted in: the model's own matmuls
    with fast_training_matmuls(model) as switched:
        assert switched == 2 * 7 + 1 and type(model.lm_head) is OneDnnLinear
        got_loss, got_grads = step()
    assert type(model.lm_head) is Linear  # given back with its own classes
    # the head's forward W @ hᵀ ([vocab, rows], the vocabulary as the long side) and its weight
    # gradient G @ h over the rows' logit gradients G [vocab, rows]: the same operand shapes
    assert onednn_calls.count(((300, 64), (64, 64))) == 2
    # 2 layers x 7 linears (q, k, v, o, gate, up, down): forward, input and weight gradients; the head's two
    assert len(onednn_calls) == 2 * 7 * 3 + 2
    want_loss, want_grads = plain
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mkl_s, onednn_s, forced, expected", [
    (1.0, 0.8, None, True),  # oneDNN clearly faster
    (1.0, 0.97, None, False),  # within the 5% margin
    (1.0, 1.3, None, False),  # MKL faster
    (1.0, 0.8, "0", False),  # turned off
    (1.0, 1.3, "1", True),  # turned on without measuring
])
def test_onednn_is_chosen_by_measuring_this_cpu(monkeypatch, mkl_s, onednn_s, forced, expected):
    if forced is None:
        monkeypatch.delenv("ASTRAI_ONEDNN_LINEAR", raising=False)
    else:
        monkeypatch.setenv("ASTRAI_ONEDNN_LINEAR", forced)
    monkeypatch.setattr(onednn_linear, "matmul_seconds", lambda transposed=False: (mkl_s, onednn_s))
    assert onednn_linear._forward_layout_pays.__wrapped__() is expected


@pytest.mark.parametrize("forward_pays, transposed_s, expected", [
    (True, (1.0, 0.6), True),  # oneDNN wins the transposed layout too
    (True, (1.0, 1.2), False),  # oneDNN wins the forward layout only
    (False, (1.0, 0.6), False),  # no oneDNN for the forward matmul: none for its gradient
])
def test_the_weight_gradient_layout_is_measured_on_its_own(monkeypatch, forward_pays, transposed_s, expected):
    monkeypatch.delenv("ASTRAI_ONEDNN_LINEAR", raising=False)
    asked = []

    def seconds(transposed=False):
        asked.append(transposed)
        return transposed_s

    monkeypatch.setattr(onednn_linear, "onednn_fp32_pays", lambda: forward_pays)
    monkeypatch.setattr(onednn_linear, "matmul_seconds", seconds)
    assert onednn_linear._weight_grad_layout_pays.__wrapped__() is expected
    assert asked == ([True] if forward_pays else [])


@pytest.mark.parametrize("transposed", [False, True])
def test_the_measurement_times_both_matmuls(transposed):
    mkl, onednn = onednn_linear.matmul_seconds(repeats=2, transposed=transposed)
    assert 0 < mkl < 1 and 0 < onednn < 1


def test_no_rows_give_a_zero_weight_gradient(onednn_calls):
    """An expert that no token chose multiplies zero rows: its weight gradient is zero, not an error."""
    x = torch.randn(0, 16, requires_grad=True)
    weight = torch.randn(8, 16, requires_grad=True)
    (grad_weight,) = torch.autograd.grad(training_linear(x, weight).sum() + weight.sum() * 0, weight)
    assert torch.equal(grad_weight, torch.zeros(8, 16))


def test_a_compiled_step_keeps_the_onednn_matmuls(monkeypatch):
    """Inside ``torch.compile`` the matmuls are the opaque ``astrai::onednn_matmul`` op, so
    a compiled fp32 step runs them on oneDNN too, with the eager step's values."""
    monkeypatch.setattr(onednn_linear, "onednn_fp32_pays", lambda: True)
    monkeypatch.setattr(onednn_linear, "onednn_weight_grad_pays", lambda: True)
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                         dim_ffn=128, max_len=64))
    ids = torch.randint(0, 300, (2, 33))

    def step(forward):
        model.zero_grad(set_to_none=True)
        loss = forward(ids[:, :-1], target_ids=ids[:, 1:])["loss"]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want_loss, want_grads = step(model)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with fast_training_matmuls(model):
        step(compiled)  # compiles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got_loss, got_grads = step(compiled)
    names = [event.name for event in prof.events()]
    # per layer 7 forward matmuls, 7 input and 7 weight gradients; the head's forward and weight gradient
    assert names.count("astrai::onednn_matmul") == 2 * 7 * 3 + 2
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_opting_out_where_onednn_does_not_pay_switches_nothing(monkeypatch):
    monkeypatch.setattr(onednn_linear, "onednn_fp32_pays", lambda: False)
    model = AutoModel.from_config(preset("tiny", vocab_size=300, dim=64, n_layers=1, dim_ffn=128, max_len=64))
    with fast_training_matmuls(model) as switched:
        assert switched == 0 and type(model.lm_head) is Linear


@pytest.mark.parametrize("bf16_pays", [False, True])
def test_the_run_keeps_the_projection_in_fp32_where_bf16_does_not_pay(monkeypatch, bf16_pays):
    """Within the block the fused loss asks this CPU whether a bf16 projection pays, and takes
    oneDNN's matmul only where the linears switched; outside it, autocast's bf16 and torch.mm."""
    monkeypatch.setattr(onednn_linear, "cpu_bf16_matmul_pays", lambda: bf16_pays)
    monkeypatch.setattr(onednn_linear, "onednn_fp32_pays", lambda: False)
    model = AutoModel.from_config(preset("tiny", vocab_size=300, dim=64, n_layers=1, dim_ffn=128, max_len=64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with fast_training_matmuls(model, {"forward": False, "weight_grad": False}):
            assert lce.projection_dtype("cpu", torch.float32) == (torch.bfloat16 if bf16_pays else torch.float32)
            assert lce._installed.matmul is None
        assert lce.projection_dtype("cpu", torch.float32) == torch.bfloat16
    with fast_training_matmuls(model, {"forward": True, "weight_grad": False}):
        assert lce._installed.matmul is onednn_linear.head_matmul
    assert lce._installed == lce.HeadMatmuls()


@pytest.mark.parametrize("bf16_s, fp32_s, amx, expected", [
    (1.0, 2.0, False, True),  # bf16 twice as fast
    (2.0, 1.2, False, False),  # bf16 slower (CPUs without native bf16 matmuls)
    (1.0, 1.1, False, False),  # within the 1.25x margin: not worth the precision
    (2.0, 1.0, True, True),  # AMX tiles: bf16 without asking
])
def test_bf16_projection_is_chosen_by_measuring_this_cpu(monkeypatch, bf16_s, fp32_s, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(onednn_linear, "_best_matmul_seconds",
                        lambda a, b: bf16_s if a.dtype == torch.bfloat16 else fp32_s)
    assert onednn_linear._bf16_matmul_measured.__wrapped__() is expected
