"""DPO, reward-model and GRPO losses read the batch's masks exactly: padding anywhere (a left-padded
batch from a user's own collate function) changes nothing, the response mask is not off by one, and an
MoE policy's balancing loss is added as in SEQ/SFT."""

import pytest
import torch
import torch.nn.functional as F

from astrai.alignment.grpo import GRPOStrategy
from astrai.alignment.losses import group_advantages
from astrai.alignment.rollout import pack_sequences
from astrai.config import preset
from astrai.errors import DataError
from astrai.model import AutoModel
from astrai.model.reward import RewardModel
from astrai.trainer.strategies import StrategyFactory

from alignment_helpers import encode_pairs, tiny_lm

MOE = dict(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, moe_dim_ffn=16, n_dense_layers=0,
           aux_loss_coef=0.1)


def left_padded(batch: dict, extra: int = 3) -> dict:
    """The same pairs with every row's tokens moved to the right end (``extra`` more pad columns)."""
    out = {}
    for side in ("chosen", "rejected"):
        ids, response = batch[side], batch[f"{side}_mask"]
        real = torch.zeros_like(ids)
        for i, row in enumerate(ids):  # encode_pairs right-pads: real tokens run up to the response's end
            real[i, :int(response[i].nonzero().max()) + 1] = 1
        width = ids.shape[1] + extra
        new_ids = torch.full((len(ids), width), 7, dtype=ids.dtype)  # a real token id, not 0: only the mask says pad
        new_response, attention = torch.zeros_like(new_ids), torch.zeros_like(new_ids)
        for i in range(len(ids)):
            n = int(real[i].sum())
            new_ids[i, width - n:] = ids[i, :n]
            new_response[i, width - n:] = response[i, :n]
            attention[i, width - n:] = 1
        out.update({side: new_ids, f"{side}_mask": new_response, f"{side}_attention_mask": attention})
    return out


def perturbed(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def pairs(tokenizer, preference_records):
    return encode_pairs(tokenizer, preference_records[:4])


def test_dpo_left_padded_batch_scores_as_the_right_padded_one(tokenizer, pairs):
    model = tiny_lm(tokenizer.vocab_size)
    strategy = StrategyFactory.create(model, "dpo", beta=0.5)
    perturbed(model)
    with torch.no_grad():
        right = strategy.compute_loss(pairs)
        margin = strategy.metrics["reward_margin"]
        left = strategy.compute_loss(left_padded(pairs))
    assert margin != 0
    torch.testing.assert_close(left, right, rtol=0, atol=1e-5)
    torch.testing.assert_close(strategy.metrics["reward_margin"], margin, rtol=0, atol=1e-5)


def test_reward_model_left_padded_batch_scores_as_the_right_padded_one(tokenizer, pairs):
    model = perturbed(RewardModel.from_base(tiny_lm(tokenizer.vocab_size)))
    strategy = StrategyFactory.create(model, "rm")
    with torch.no_grad():
        right = strategy.compute_loss(pairs)
        chosen = strategy.metrics["reward_chosen"]
        left = strategy.compute_loss(left_padded(pairs))
    torch.testing.assert_close(left, right, rtol=0, atol=1e-5)
    torch.testing.assert_close(strategy.metrics["reward_chosen"], chosen, rtol=0, atol=1e-5)


def test_padding_marked_as_response_is_refused(tokenizer, pairs):
    batch = left_padded(pairs)
    batch["chosen_mask"][0, 0] = 1  # a pad column inside the response
    strategy = StrategyFactory.create(tiny_lm(tokenizer.vocab_size), "dpo")
    with pytest.raises(DataError, match=r"pair\(s\) \[0\] mark padding .* chosen response"):
        strategy.compute_loss(batch)


def test_grpo_left_padded_prompts_score_as_unpadded_ones(tokenizer):
    """Stored GRPO rows: left-padded prompts (with prompt_mask) give the loss of the unpadded sequences."""
    model = tiny_lm(tokenizer.vocab_size)
    strategy = GRPOStrategy(model, group_size=2)
    perturbed(model)
    prompt, responses = tokenizer.encode("10+20="), [tokenizer.encode("30"), tokenizer.encode("31")]
    pad = 3
    prompts = torch.tensor([[7] * pad + prompt] * 2)  # 7 is a real token id: only the mask says padding
    prompt_mask = torch.tensor([[0] * pad + [1] * len(prompt)] * 2)
    width = max(map(len, responses)) + 1
    response_ids = torch.tensor([r + [7] * (width - len(r)) for r in responses])
    masks = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])
    rewards = torch.tensor([1.0, 0.0])
    with torch.no_grad():
        got = strategy.compute_loss({"prompts": prompts, "prompt_mask": prompt_mask, "responses": response_ids,
                                     "masks": masks, "rewards": rewards})
        ids, response_mask = pack_sequences([prompt, prompt], responses)
        expected = strategy.policy_loss(ids, response_mask, rewards, advantages=group_advantages(rewards, 2))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def hand_sequence_logprob(model, ids: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """Σ over response tokens t of log p(ids[t] | ids[:t]): the logits at position t - 1 score token t."""
    logp = F.log_softmax(model(ids[None])["logits"][0].float(), -1)
    return sum(logp[t - 1, ids[t]] for t in response.nonzero().flatten().tolist())


def test_dpo_scores_exactly_the_response_tokens(tokenizer, pairs):
    """A mask shifted by one position (scoring the token before the answer, or missing its last) fails here."""
    model = tiny_lm(tokenizer.vocab_size)
    strategy = StrategyFactory.create(model, "dpo", beta=1.0)
    perturbed(model)
    batch = {k: v[:1] for k, v in pairs.items()}
    with torch.no_grad():
        loss = strategy.compute_loss(batch)
        policy = [hand_sequence_logprob(model, batch[s][0], batch[f"{s}_mask"][0]) for s in ("chosen", "rejected")]
        ref = [hand_sequence_logprob(strategy.ref_model, batch[s][0], batch[f"{s}_mask"][0]) for s in ("chosen", "rejected")]
    expected = -F.logsigmoid((policy[0] - ref[0]) - (policy[1] - ref[1]))
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-4)


def test_reward_is_read_at_the_last_response_token(tokenizer, pairs):
    model = perturbed(RewardModel.from_base(tiny_lm(tokenizer.vocab_size))).eval()
    strategy = StrategyFactory.create(model, "rm")
    batch = {k: v[:1] for k, v in pairs.items()}
    with torch.no_grad():
        strategy.compute_loss(batch)
        last = int(batch["chosen_mask"][0].nonzero().max())
        at_last = model.score(batch["chosen"][:, :last + 1])
        before_last = model.score(batch["chosen"][:, :last])
    torch.testing.assert_close(strategy.metrics["reward_chosen"], at_last[0], rtol=0, atol=1e-5)
    assert not torch.allclose(at_last, before_last, atol=1e-5)


def moe_lm(vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModel.from_config(preset("tiny", vocab_size=vocab_size, dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                        dim_ffn=64, max_len=128, **MOE))


@pytest.mark.parametrize("train_type", ["dpo", "rm", "grpo"])
def test_moe_balancing_loss_is_added(train_type, tokenizer, pairs):
    model = moe_lm(tokenizer.vocab_size)
    if train_type == "rm":
        model = RewardModel.from_base(model)
    model.train()
    strategy = StrategyFactory.create(model, train_type, **({"group_size": 2} if train_type == "grpo" else {}))
    if train_type == "grpo":
        batch = {"prompts": torch.tensor([[5, 6, 7], [5, 6, 7]]), "prompt_mask": torch.ones(2, 3, dtype=torch.long),
                 "responses": torch.tensor([[8, 9], [9, 8]]), "masks": torch.ones(2, 2, dtype=torch.long),
                 "rewards": torch.tensor([1.0, 0.0])}
    else:
        batch = pairs
    loss = strategy.compute_loss(batch)
    objective = strategy.metrics[f"{train_type}_loss"]
    aux = sum(layer.mlp.aux_loss for layer in model.layers)
    assert float(aux.detach()) > 0
    torch.testing.assert_close(loss.detach(), objective + aux.detach(), rtol=0, atol=1e-6)
