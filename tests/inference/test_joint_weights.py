"""Linears that read the same input (q/k/v, gate/up): stacked in one buffer by the engine's
weight layout and read as one product, for one row (the C kernel) and for several (the
joint weight's packed copy), with the same results as one product per linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.inference.weight_layout import lay_out_linears
from astrai.model.components import layers
from astrai.model.components.joint_weights import joint_groups, joint_weight
from astrai.model.components.layers import linear_group
from astrai.model.components.packed_weights import onednn_available, pack_linears, packed_joint_weight
from inference_helpers import make_model

GATED = dict(attn_bias=True, use_gated_attention=True)


def _weights(group):
    return [m.weight for m in group]


@pytest.mark.parametrize("kind,overrides", [("tiny", GATED), ("tiny-mla", {}), ("tiny-moe", {})])
def test_layout_puts_each_group_in_one_buffer_and_keeps_the_model(kind, overrides):
    model = make_model(kind, **overrides)
    groups = list(joint_groups(model))
    assert groups and all(joint_weight(_weights(g)) is None for g in groups)
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        want = model(ids)["logits"]

    assert lay_out_linears(model) > 0
    for group in groups:
        joint = joint_weight(_weights(group))
        assert joint is not None
        assert joint.shape == (sum(m.out_features for m in group), group[0].in_features)
        assert torch.equal(joint, torch.cat([m.weight.detach() for m in group]))
    assert dict(model.named_parameters()) == params  # the same Parameter objects, the same values
    for name, p in params.items():
        assert torch.equal(p, values[name]), name
    with torch.no_grad():
        assert torch.allclose(model(ids)["logits"], want, atol=1e-5, rtol=1e-5)
    assert lay_out_linears(model) == 0  # already laid out


@pytest.mark.parametrize("rows", [1, 5])
def test_a_group_runs_as_one_product(rows, monkeypatch):
    assert onednn_available()  # x86 builds of torch have it; CI runs on one
    model = make_model("tiny", **GATED)
    lay_out_linears(model)
    pack_linears(model)
    group = model.layers[0].attention.joint_linears()[0]
    assert len(group) == 4  # q, k, v and the output gate
    biased = [m for m in group if m.bias is not None]
    assert len(biased) == 3  # q, k and v have biases with attn_bias, the gate not
    for m in biased:
        torch.nn.init.normal_(m.bias)
    kernel_widths, packed_widths = [], []
    real_kernel, real_packed = layers.row_product, layers.packed_linear
    monkeypatch.setattr(layers, "row_product",
                        lambda x, w, b=None: kernel_widths.append(w.shape[0]) or real_kernel(x, w, b))

    def spy_packed(x, packed, bias):
        out = real_packed(x, packed, bias)
        packed_widths.append(out.shape[-1])
        return out

    monkeypatch.setattr(layers, "packed_linear", spy_packed)
    x = torch.randn(1, rows, 64)
    with torch.no_grad():
        got = linear_group(x, group)
    for part, m in zip(got, group):
        assert torch.allclose(part, F.linear(x, m.weight, m.bias), atol=1e-5, rtol=1e-5)
    total = sum(m.out_features for m in group)
    assert (kernel_widths, packed_widths) == (([total], []) if rows == 1 else ([], [total]))


def test_a_group_follows_its_weights_when_they_change(monkeypatch):
    model = make_model("tiny")
    lay_out_linears(model)
    pack_linears(model)
    mlp = model.layers[0].mlp
    group = (mlp.gate, mlp.up)
    joint = joint_weight(_weights(group))
    one, several = torch.randn(1, 1, 64), torch.randn(2, 3, 64)

    def check():
        for x in (one, several):
            with torch.no_grad():
                got = linear_group(x, group)
            for part, m in zip(got, group):
                assert torch.allclose(part, F.linear(x, m.weight, m.bias), atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        mlp.up.weight.mul_(-2.0)  # in place (an optimizer step, load_state_dict): packed again
    check()
    assert joint_weight(_weights(group)) is joint and packed_joint_weight(joint, _weights(group)) is not None
    mlp.gate.weight.data = torch.randn(128, 64)  # a new tensor: no longer side by side
    assert joint_weight(_weights(group)) is None
    check()
    calls = []  # autograd on: each linear's own product, for its gradient
    monkeypatch.setattr(layers, "row_product", lambda *a: calls.append(1))
    lay_out_linears(model)  # lays the group out again
    assert joint_weight(_weights(group)) is not None
    outs = linear_group(one, group)
    assert calls == [] and all(o.requires_grad for o in outs)
