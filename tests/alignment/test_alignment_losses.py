"""The alignment losses against hand computations (no model involved)."""

import math

import pytest
import torch

from astrai.alignment.losses import (dpo_loss, group_advantages, grpo_loss, keyed_group_advantages, kl_stage_loss,
                                     pairwise_reward_loss, token_logprobs)
from astrai.errors import ConfigError


def test_dpo_loss_is_ln2_when_policy_equals_reference():
    logps = torch.tensor([-3.5, -10.0, -0.25])
    loss, metrics = dpo_loss(logps, logps - 2.0, logps, logps - 2.0, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["reward_margin"] == 0.0 and metrics["reward_accuracy"] == 0.0


def test_dpo_loss_and_gradient_match_hand_computation():
    pc = torch.tensor([-4.0, -6.0], requires_grad=True)
    pr = torch.tensor([-5.0, -5.0], requires_grad=True)
    rc, rr = torch.tensor([-4.5, -5.5]), torch.tensor([-4.0, -6.5])
    beta = 0.5
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=beta)
    loss.backward()
    margins = [beta * ((-4.0 + 4.5) - (-5.0 + 4.0)), beta * ((-6.0 + 5.5) - (-5.0 + 6.5))]  # 0.75, -1.0
    sig = [1 / (1 + math.exp(-m)) for m in margins]
    expected = sum(-math.log(s) for s in sig) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # d/dpc of -log σ(m)/2 = -(1-σ(m))·β/2, and the opposite sign for the rejected log-prob
    assert pc.grad.tolist() == pytest.approx([-(1 - s) * beta / 2 for s in sig], rel=1e-6)
    assert pr.grad.tolist() == pytest.approx([(1 - s) * beta / 2 for s in sig], rel=1e-6)
    assert metrics["reward_accuracy"] == 0.5
    assert metrics["reward_margin"] == pytest.approx(sum(margins) / 2)
    summed, _ = dpo_loss(pc, pr, rc, rr, beta=beta, reduction="sum")
    assert summed.item() == pytest.approx(2 * expected, rel=1e-6)
    with pytest.raises(ConfigError, match="reduction"):
        dpo_loss(pc, pr, rc, rr, reduction="max")


def test_pairwise_reward_loss():
    loss, metrics = pairwise_reward_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    expected = (-math.log(1 / (1 + math.exp(-1))) - math.log(1 / (1 + math.exp(1)))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["reward_accuracy"] == 0.5


def test_group_advantages_normalise_within_groups():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5]), group_size=4)
    assert adv[:4].tolist() == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    # equal rewards whose float mean misses them by a rounding step (eight 0.1s) still get zeros
    assert group_advantages(torch.full((8,), 0.1), group_size=8).tolist() == [0.0] * 8
    assert keyed_group_advantages(torch.full((8,), 0.1), [0] * 8).tolist() == [0.0] * 8
    with pytest.raises(ConfigError, match="group_size"):
        group_advantages(torch.ones(4), group_size=1)
    with pytest.raises(ConfigError, match="group_size=4"):
        group_advantages(torch.ones(6), group_size=4)


def test_grpo_zero_advantage_gives_zero_policy_gradient():
    logp = torch.randn(4, 5, requires_grad=True)
    ref = torch.randn(4, 5)
    loss, _ = grpo_loss(logp, logp.detach(), ref, torch.zeros(4), torch.ones(4, 5), kl_coef=0.0)
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_grpo_kl_is_zero_when_policy_equals_reference():
    logp = torch.randn(3, 6, requires_grad=True)
    loss, metrics = grpo_loss(logp, logp.detach(), logp.detach(), torch.zeros(3), torch.ones(3, 6), kl_coef=0.5)
    loss.backward()
    assert metrics["kl"] == 0.0 and loss.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0


def test_grpo_clipping_follows_the_formula():
    old = torch.zeros(1, 4)
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5]])
    logp = ratios.log().requires_grad_(True)
    mask = torch.ones(1, 4)
    for adv in (1.0, -1.0):
        logp.grad = None
        loss, metrics = grpo_loss(logp, old, logp.detach(), torch.tensor([adv]), mask, clip_eps=0.2, kl_coef=0.0)
        expected = -sum(min(r * adv, min(max(r, 0.8), 1.2) * adv) for r in ratios[0].tolist()) / 4
        assert loss.item() == pytest.approx(expected, rel=1e-6)
        assert metrics["clip_fraction"] == 0.5
        loss.backward()
        # a token's gradient vanishes exactly where the clipped term is the minimum
        active = [r * adv <= min(max(r, 0.8), 1.2) * adv for r in ratios[0].tolist()]
        assert [g != 0 for g in logp.grad[0].tolist()] == active


def test_grpo_without_a_reference_is_the_policy_term_alone():
    logp = torch.randn(2, 4, requires_grad=True)
    old = logp.detach() + 0.1
    adv, mask = torch.tensor([1.0, -0.5]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    loss, metrics = grpo_loss(logp, old, None, adv, mask, kl_coef=0.5)
    with_reference, _ = grpo_loss(logp, old, torch.randn(2, 4), adv, mask, kl_coef=0.0)
    assert loss.item() == pytest.approx(with_reference.item(), rel=1e-6) and loss.item() != 0.0
    assert "kl" not in metrics and set(metrics) == {"policy_loss", "clip_fraction"}


def test_grpo_masks_padding_and_weighs_kl():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = grpo_loss(logp, logp.detach(), ref, torch.zeros(1), mask, kl_coef=0.01)
    assert metrics["kl"] == pytest.approx(0.25 / 2)
    assert loss.item() == pytest.approx(0.01 * 0.25 / 2)


def test_token_logprobs_and_kl_stage_loss():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
    nll = torch.tensor(2.0, requires_grad=True)
    total, penalty = kl_stage_loss(nll, torch.tensor(1.5), beta=0.0)
    assert total.item() == 2.0 and penalty.item() == 0.5
    total, _ = kl_stage_loss(nll, torch.tensor(1.5), beta=0.2)
    total.backward()
    assert total.item() == pytest.approx(2.1) and nll.grad.item() == pytest.approx(1.2)
