"""GRPO's packed groups (one row per prompt, its responses behind it) score as one row per response does."""

import random

import pytest
import torch

import astrai.alignment.dpo as dpo_module
from astrai.alignment.dpo import DPOStrategy
from astrai.alignment.group_packing import (model_max_len, pack_groups, packed_logprobs_and_aux, packed_rows,
                                            split_rows)
from astrai.alignment.grpo import GRPOStrategy
from astrai.alignment.preference import stack_attention, stack_pairs
from astrai.alignment.losses import shifted_token_logprobs
from astrai.alignment.rollout import pack_sequences
from astrai.config import preset
from astrai.model import AutoModel

from alignment_helpers import tiny_lm


def rollout_rows(seed=0, groups=3, group_size=4, vocab=64):
    """Consecutive groups of responses of uneven lengths behind prompts of uneven lengths."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 12))]
        for _ in range(group_size):
            prompts.append(prompt)
            responses.append([rng.randrange(1, vocab) for _ in range(rng.randint(1, 7))])
    return prompts, responses


@pytest.mark.parametrize("variant", ["tiny", "tiny-mla", "tiny-moe"])
def test_packed_logprobs_equal_one_row_per_response(variant):
    torch.manual_seed(0)
    overrides = dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, dim_ffn=64, max_len=128)
    if variant == "tiny-mla":
        overrides.update(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
    else:
        overrides["n_kv_heads"] = 1
    model = AutoModel.from_config(preset(variant, **overrides)).train()
    prompts, responses = rollout_rows()
    ids, response_mask = pack_sequences(prompts, responses)
    assert split_rows(ids, response_mask) == (prompts, responses)
    packed = pack_groups(prompts, responses)
    assert packed.input_ids.shape[0] == 3  # one row per prompt
    assert packed.tokens < ids.numel()

    plain = shifted_token_logprobs(model, ids)
    mask = response_mask[:, 1:].bool()
    weights = torch.randn(mask.sum().item())
    (plain[mask] * weights).sum().backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    logp, _ = packed_logprobs_and_aux(model, packed)
    assert packed.mask.sum() == mask.sum()
    # the same tokens in the same order, row by row
    torch.testing.assert_close(logp[packed.mask.bool()], plain[mask], atol=2e-5, rtol=1e-5)
    (logp[packed.mask.bool()] * weights).sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), plain_grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_responses_do_not_see_their_siblings():
    model = tiny_lm(64).eval()
    prompts, responses = rollout_rows(groups=1, group_size=3)
    before = packed_logprobs_and_aux(model, pack_groups(prompts, responses))[0]
    changed = [responses[0], [9, 9, 9, 9, 9, 9, 9], responses[2]]
    after = packed_logprobs_and_aux(model, pack_groups(prompts, changed))[0]
    torch.testing.assert_close(after[0], before[0])
    torch.testing.assert_close(after[2], before[2])
    assert not torch.allclose(after[1], before[1])


def test_rows_sharing_a_prompt_anywhere_are_packed_together():
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3]]
    responses = [[6], [7, 8], [9, 10]]
    packed = pack_groups(prompts, responses)
    assert packed.input_ids.tolist() == [[1, 2, 3, 6, 9, 10], [4, 5, 7, 8, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 3, 4], [0, 1, 2, 3, 0, 0]]
    # the first token of each response is scored from the prompt's last position
    assert packed.logits_index.tolist() == [[2, 2, 4], [1, 2, 0]]
    assert packed.targets.tolist() == [[6, 9, 10], [7, 8, 0]]
    assert packed.mask.tolist() == [[1, 0], [1, 1], [1, 1]]
    assert pack_groups([[1]], [[]]) is None


def test_grpo_loss_is_the_same_packed_or_not():
    model = tiny_lm(64).train()
    prompts, responses = rollout_rows(seed=3)
    ids, response_mask = pack_sequences(prompts, responses)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(prompts))])
    losses, grads = [], []
    for share in (True, False):
        strategy = GRPOStrategy(model, group_size=4, kl_coef=0.1, share_prompts=share)
        with torch.no_grad():  # move the policy off its reference so the KL term counts
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(7)))
        loss = strategy.policy_loss(ids, response_mask, rewards)
        loss.backward()
        losses.append((loss.item(), strategy.metrics["kl"].item(), strategy.metrics["response_length"].item()))
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(7)))
    assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
    assert losses[0][1] > 0
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_packing_falls_back_when_a_packed_row_would_not_fit():
    model = tiny_lm(64)  # max_len 128
    prompts = [[1] * 60] * 4
    responses = [[2] * 20] * 4  # packed: 60 + 80 = 140 positions
    ids, response_mask = pack_sequences(prompts, responses)
    strategy = GRPOStrategy(model, group_size=4)
    _, mask = strategy.token_scorer(ids, response_mask)
    assert mask.shape == (4, ids.shape[1] - 1)  # one row per response
    _, mask = strategy.token_scorer(ids[:, :70], response_mask[:, :70])  # 60 + 4 x 10 fits
    assert mask.shape == (4, 10)


def test_split_rows_drops_prompt_padding_and_refuses_a_response_with_gaps():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [3, 4, 5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert split_rows(ids, mask, attention) == ([[5, 6], [3, 4]], [[7, 8], [5, 6, 7]])
    assert split_rows(ids, torch.tensor([[0, 0, 0, 1, 0, 1, 0], [0, 0, 1, 1, 1, 0, 0]])) is None


def dpo_batch(seed=0, pairs=3, vocab=64, left_pad=False):
    """Pairs whose chosen and rejected answers follow one prompt; with ``left_pad``, prompts padded
    on the left under attention masks, as a user's own collate function may do."""
    rng = random.Random(seed)
    rows = {"chosen": [], "rejected": []}
    for _ in range(pairs):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 10))]
        for side in rows:
            rows[side].append((prompt, [rng.randrange(1, vocab) for _ in range(rng.randint(1, 6))]))
    batch = {}
    for side, items in rows.items():
        P = max(len(p) for p, _ in items)
        L = P + max(len(a) for _, a in items)
        ids, mask, attention = (torch.zeros(len(items), L, dtype=torch.long) for _ in range(3))
        for i, (p, a) in enumerate(items):
            start = P - len(p) if left_pad else 0
            ids[i, start:start + len(p) + len(a)] = torch.tensor(p + a)
            mask[i, start + len(p):start + len(p) + len(a)] = 1
            attention[i, start:start + len(p) + len(a)] = 1
        batch.update({side: ids, f"{side}_mask": mask})
        if left_pad:
            batch[f"{side}_attention_mask"] = attention
    return batch


@pytest.mark.parametrize("left_pad", [False, True])
def test_dpo_loss_is_the_same_packed_or_not(left_pad):
    model = tiny_lm(64).train()
    batch = dpo_batch(left_pad=left_pad)
    results = []
    for share in (True, False):
        strategy = DPOStrategy(model, beta=0.5, rpo_alpha=1.0, share_prompts=share)
        with torch.no_grad():  # the policy away from its reference, so the DPO term is not flat
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p, generator=torch.Generator().manual_seed(3)))
        loss = strategy.compute_loss(batch)
        loss.backward()
        results.append((loss.item(), strategy.metrics["chosen_nll"].item(),
                        [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.02 * torch.randn_like(p, generator=torch.Generator().manual_seed(3)))
    packed, plain = results
    # the batch does pack: each pair's prompt once, its padding dropped
    assert packed_rows(*stack_pairs(batch), model_max_len(model), stack_attention(batch)).input_ids.shape[0] == 3
    assert packed[0] == pytest.approx(plain[0], rel=1e-4) and packed[1] == pytest.approx(plain[1], rel=1e-4)
    for got, want in zip(packed[2], plain[2]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_dpo_packs_each_pair_into_one_row():
    model = tiny_lm(64)
    batch = dpo_batch(pairs=4)
    ids, mask = stack_pairs(batch)
    packed = packed_rows(ids, mask, model_max_len(model))
    assert packed.input_ids.shape[0] == 4 and packed.tokens < ids.numel()


def test_dpo_strategy_scores_through_the_packed_rows(monkeypatch):
    calls = []
    real = dpo_module.packed_logprobs_and_aux
    monkeypatch.setattr(dpo_module, "packed_logprobs_and_aux",
                        lambda model, packed: calls.append(packed.input_ids.shape[0]) or real(model, packed))
    model = tiny_lm(64).train()
    DPOStrategy(model, beta=0.5).compute_loss(dpo_batch(pairs=3))
    assert calls == [3, 3]  # the policy and the reference, one row per pair each
    calls.clear()
    DPOStrategy(model, beta=0.5, share_prompts=False).compute_loss(dpo_batch(pairs=3))
    assert calls == []
