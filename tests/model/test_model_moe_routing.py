"""DeepSeekMoE: normalised routing weights, aux loss in training, gradient to every chosen expert."""

import pytest
import torch

from astrai.config import preset
from astrai.model import AutoModel, DeepSeekMoE

MOE = dict(vocab_size=128, dim=64, n_layers=2, dim_ffn=128, ffn_type="moe", n_routed_experts=6, n_shared_experts=1,
           n_activated_experts=2, moe_dim_ffn=32, n_dense_layers=1)


@pytest.mark.parametrize("method", ["greedy", "sigmoid"])
def test_routed_weights_sum_to_one(method):
    torch.manual_seed(0)
    moe = DeepSeekMoE(preset("tiny", **MOE, moe_topk_method=method))
    weights, indices, scores = moe.route(torch.randn(50, 64))
    assert weights.shape == indices.shape == (50, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    assert (indices[:, 0] != indices[:, 1]).all()
    picked = scores.gather(1, indices)
    assert (picked.min(-1).values >= scores.topk(2, -1).values.min(-1).values - 1e-7).all()


def test_aux_loss_in_training_mode_only():
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **MOE))
    ids = torch.randint(0, 128, (2, 16))
    out = model.train()(ids)
    assert "aux_loss" in out and out["aux_loss"].requires_grad and out["aux_loss"].item() > 0
    with torch.no_grad():
        assert "aux_loss" not in model.eval()(ids)
    stats = model.router_stats()
    assert list(stats) == ["layer1"] and abs(sum(stats["layer1"]) - 1.0) < 1e-6


def test_gradient_reaches_every_chosen_expert_and_only_those():
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **MOE)).train()
    ids = torch.randint(0, 128, (1, 3))
    moe = model.layers[1].mlp
    chosen = set()
    hook = moe.register_forward_hook(lambda m, inp, _: chosen.update(m.route(inp[0].reshape(-1, 64))[1].flatten().tolist()))
    out = model(ids)
    hook.remove()
    (out["logits"].sum() + out["aux_loss"]).backward()
    assert 0 < len(chosen) < 6
    for i, expert in enumerate(moe.routed_experts):
        has_grad = expert.gate.weight.grad is not None and expert.gate.weight.grad.abs().sum() > 0
        assert has_grad == (i in chosen), f"expert {i}: chosen={i in chosen}, grad={has_grad}"
        # idle experts get a zero gradient, not none: DDP and FSDP need every rank to reduce every parameter
        assert all(p.grad is not None for p in expert.parameters()), f"expert {i} has no gradient"
    assert moe.router.weight.grad.abs().sum() > 0
    assert moe.shared_experts[0].up.weight.grad.abs().sum() > 0


def test_idle_experts_do_not_run_at_inference():
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", **MOE)).eval()
    moe = model.layers[1].mlp
    calls = []
    for i, expert in enumerate(moe.routed_experts):
        expert.register_forward_hook(lambda m, inp, out, i=i: calls.append((i, inp[0].shape[0])))
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 2)))
    assert 0 < len(calls) <= 4 and all(rows > 0 for _, rows in calls)
