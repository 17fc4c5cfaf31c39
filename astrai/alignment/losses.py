"""The alignment losses as pure tensor functions, so each can be checked by hand.

Every strategy (DPO, reward model, GRPO, KL-staged) is a thin shell that runs the
model and hands the numbers to one of these. Response tokens are always selected by
a 0/1 mask, never by comparing token ids with a padding id: a padding id can be a
real token, and prompts differ in length.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from astrai.errors import ConfigError

REDUCTIONS = ("mean", "sum")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t]) under ``logits[b, t]``, in fp32: [B, T, V] x [B, T] → [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def padded_inputs(attention_mask: torch.Tensor | None) -> dict:
    """Model arguments for a padded batch: padding (1 = real token, 0 = padding, anywhere in the
    row) is masked out and positions count real tokens only, so each row scores as it would alone."""
    if attention_mask is None:
        return {}
    mask = attention_mask.long()
    return {"input_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}


def shifted_logprobs_and_aux(model, input_ids: torch.Tensor,
                             attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of ``input_ids[:, 1:]`` given their prefixes ([B, T] → [B, T-1]) and the
    model's MoE balancing loss (None for a dense model or outside training)."""
    mask = None if attention_mask is None else attention_mask[:, :-1]
    outputs = model(input_ids[:, :-1], **padded_inputs(mask))
    return token_logprobs(outputs["logits"], input_ids[:, 1:]), outputs.get("aux_loss")


def shifted_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log-probs of ``input_ids[:, 1:]`` given their prefixes: [B, T] → [B, T-1].

    Position t of the result scores token t+1, so a response mask aligned with
    ``input_ids`` selects it with ``mask[:, 1:]``.
    """
    return shifted_logprobs_and_aux(model, input_ids, attention_mask)[0]


def response_sums(per_token: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sum of shifted per-token log-probs over the tokens where ``response_mask`` is 1: [B, T-1] → [B]."""
    return (per_token * response_mask[:, 1:].to(per_token.dtype)).sum(-1)


def sequence_logprobs(model, input_ids: torch.Tensor, response_mask: torch.Tensor,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of log p over the tokens where ``response_mask`` is 1: [B, T] → [B]."""
    return response_sums(shifted_token_logprobs(model, input_ids, attention_mask), response_mask)


def reduce(values: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mean or sum over a batch of per-example losses."""
    if reduction == "mean":
        return values.mean()
    if reduction == "sum":
        return values.sum()
    raise ConfigError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, reduction: str = "mean") -> tuple[torch.Tensor, dict]:
    """L = −log σ(β·[(π_w − ref_w) − (π_l − ref_l)]) on summed sequence log-probs [B].

    The implicit rewards β·(π − ref) of each answer are returned as metrics; accuracy
    is the share of pairs whose chosen reward beats the rejected one.
    """
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    loss = reduce(-F.logsigmoid(margin), reduction)
    metrics = {
        "reward_chosen": chosen_reward.detach().mean(),
        "reward_rejected": rejected_reward.detach().mean(),
        "reward_margin": margin.detach().mean(),
        "reward_accuracy": (margin.detach() > 0).float().mean(),
    }
    return loss, metrics


def pairwise_reward_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, reduction: str = "mean") -> tuple[torch.Tensor, dict]:
    """Bradley–Terry loss of a reward model: L_RM = −log σ(r(x, y_w) − r(x, y_l))."""
    diff = r_chosen - r_rejected
    loss = reduce(-F.logsigmoid(diff), reduction)
    metrics = {
        "reward_chosen": r_chosen.detach().mean(),
        "reward_rejected": r_rejected.detach().mean(),
        "reward_accuracy": (diff.detach() > 0).float().mean(),
    }
    return loss, metrics


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i − μ_g) / (σ_g + ε) within consecutive groups of ``group_size``.

    σ is the population standard deviation, so a group of identical rewards gets
    exactly zero advantage (there is nothing to prefer).
    """
    if group_size < 2:
        raise ConfigError(f"group_size must be >= 2 to compare responses within a group, got {group_size}")
    if rewards.numel() % group_size:
        raise ConfigError(f"{rewards.numel()} rewards do not split into groups of group_size={group_size}")
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)
    # a mean of equal floats can miss them by a rounding step (eight 0.1s), and that step over
    # σ + ε is a spurious advantage of about 1%: a group whose rewards are all equal gets zeros
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(constant, 0.0, (grouped - mean) / (std + eps)).view(-1)


def keyed_group_advantages(rewards: torch.Tensor, keys: list, eps: float = 1e-6) -> torch.Tensor:
    """Advantages normalised among rows that share a key (the prompt), for stored (offline) data.

    A prompt with a single response in the batch has nothing to be compared with and
    gets advantage 0.
    """
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    for rows in groups.values():
        if len(rows) > 1:
            advantages[rows] = group_advantages(rewards[rows], len(rows), eps)
    return advantages


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: Optional[torch.Tensor], advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, kl_coef: float = 0.01,
              reduction: str = "mean") -> tuple[torch.Tensor, dict]:
    """Clipped surrogate with a squared-log-ratio KL penalty, per response token.

    ``logp``, ``old_logp`` (the behaviour policy that sampled the responses) and
    ``ref_logp`` (the frozen reference; None without the KL term) are [N, T] token log-probs,
    ``advantages`` is [N] and ``mask`` [N, T] marks response tokens. Each response's tokens are
    averaged first, so a long answer counts as much as a short one; the responses
    are then averaged ("mean") or summed ("sum").
    """
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    policy_term = -torch.minimum(unclipped, clipped)
    per_token = policy_term
    kl_term = None
    if ref_logp is not None:
        kl_term = (logp - ref_logp.detach()).pow(2)
        per_token = policy_term + kl_coef * kl_term
    loss = reduce(masked_mean(per_token, mask, dim=1), reduction)
    with torch.no_grad():
        clipped_tokens = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)).float()
        metrics = {"policy_loss": masked_mean(policy_term, mask), "clip_fraction": masked_mean(clipped_tokens, mask)}
        if kl_term is not None:
            metrics["kl"] = masked_mean(kl_term, mask)
    return loss, metrics


def token_kl(policy_logits: torch.Tensor, reference_logits: torch.Tensor, targets: torch.Tensor,
             ignore_index: int = -100) -> torch.Tensor:
    """Exact KL(policy ‖ reference) over the vocabulary, averaged over the positions whose target counts.

    Σ_v p(v)·(log p(v) − log q(v)) per position, in fp32: never negative, zero only where the two
    distributions agree, and its gradient pulls the policy towards the reference.
    """
    logp = torch.log_softmax(policy_logits.float(), dim=-1)
    logq = torch.log_softmax(reference_logits.detach().float(), dim=-1)
    per_position = (logp.exp() * (logp - logq)).sum(-1)
    mask = (targets != ignore_index).to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1)


def kl_stage_loss(policy_nll: torch.Tensor, reference_nll: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec 003's second-stage objective: NLL + β·(policy NLL − stop-grad reference NLL).

    Returns (total loss, the penalty term). With β = 0 the total is the plain NLL. The penalty's
    gradient is the policy NLL's own, so it rescales the step rather than anchoring the model
    (``token_kl`` does that); the KL stage offers it as the ``nll_difference`` estimate.
    """
    penalty = policy_nll - reference_nll.detach()
    return policy_nll + beta * penalty, penalty
