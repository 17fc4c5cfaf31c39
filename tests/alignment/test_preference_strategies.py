"""DPO and reward-model strategies on the bundled preference pairs, with tiny models."""

import math

import pytest
import torch

from astrai.alignment.dpo import DPOStrategy
from astrai.alignment.losses import sequence_logprobs
from astrai.alignment.preference import stack_pairs
from astrai.alignment.reward_model import pair_scores
from astrai.errors import ConfigError, DataError
from astrai.model.lora import LoraConfig, adapters_disabled, inject_lora
from astrai.model.reward import RewardModel
from astrai.trainer.strategies import StrategyFactory

from alignment_helpers import encode_pairs, tiny_lm


def test_dpo_starts_at_ln2_and_reward_accuracy_rises(tokenizer, preference_records):
    torch.manual_seed(0)
    model = tiny_lm(tokenizer.vocab_size)
    strategy = StrategyFactory.create(model, "dpo", beta=0.1)
    assert isinstance(strategy, DPOStrategy) and strategy.ref_model is not model
    batches = [encode_pairs(tokenizer, preference_records[i:i + 16]) for i in range(0, 64, 16)]
    loss = strategy.compute_loss(batches[0])
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert strategy.metrics["reward_accuracy"] == 0.0  # margins are exactly 0 at the start
    ref_before = {k: v.clone() for k, v in strategy.ref_model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(8):
        loss = strategy.compute_loss(batches[step % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()
    accuracies = []
    with torch.no_grad():
        for batch in batches:
            strategy.compute_loss(batch)
            accuracies.append(strategy.metrics["reward_accuracy"])
    assert sum(accuracies) / len(accuracies) > 0.7, accuracies
    assert all(torch.equal(v, ref_before[k]) for k, v in strategy.ref_model.state_dict().items())


def test_dpo_reference_from_checkpoint_and_reduction(tokenizer, preference_records, tmp_path):
    base = tiny_lm(tokenizer.vocab_size, seed=1)
    base.save_pretrained(tmp_path)
    policy = tiny_lm(tokenizer.vocab_size, seed=2)
    strategy = DPOStrategy(policy, ref_path=str(tmp_path), reduction="sum")
    batch = encode_pairs(tokenizer, preference_records[:4])
    ids, mask = stack_pairs(batch)
    with torch.no_grad():
        expected = sequence_logprobs(base, ids, mask)
        assert torch.allclose(sequence_logprobs(strategy.ref_model, ids, mask), expected)
        pol = sequence_logprobs(policy, ids, mask)
    margin = 0.1 * ((pol[:4] - expected[:4]) - (pol[4:] - expected[4:]))
    loss = strategy.compute_loss(batch)
    assert loss.item() == pytest.approx(torch.nn.functional.softplus(-margin).sum().item(), rel=1e-5)


def test_rpo_alpha_adds_the_chosen_answers_nll_per_token(tokenizer, preference_records):
    """DPO + α·NLL(chosen): the loss grows by exactly α times the chosen answers' mean
    per-token negative log-likelihood, and training with it keeps the chosen answers
    likelier than DPO alone does."""
    batch = encode_pairs(tokenizer, preference_records[:8])
    ids, mask = stack_pairs(batch)
    plain = DPOStrategy(tiny_lm(tokenizer.vocab_size, seed=3), beta=0.1)
    rpo = DPOStrategy(tiny_lm(tokenizer.vocab_size, seed=3), beta=0.1, rpo_alpha=0.5)
    with torch.no_grad():
        chosen = sequence_logprobs(plain.model, ids[:8], mask[:8])
    nll = (-chosen / mask[:8, 1:].sum(dim=1)).mean()
    assert rpo.compute_loss(batch).item() == pytest.approx(plain.compute_loss(batch).item() + 0.5 * nll.item(), rel=1e-5)
    assert rpo.metrics["chosen_nll"].item() == pytest.approx(nll.item(), rel=1e-5) and "chosen_nll" not in plain.metrics
    with pytest.raises(ConfigError, match="rpo_alpha must be >= 0"):
        DPOStrategy(tiny_lm(tokenizer.vocab_size), rpo_alpha=-1)

    def chosen_logprob_after_training(strategy):
        opt = torch.optim.AdamW(strategy.model.parameters(), lr=3e-3)
        for _ in range(6):
            loss = strategy.compute_loss(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return sequence_logprobs(strategy.model, ids[:8], mask[:8]).mean().item()

    assert chosen_logprob_after_training(rpo) > chosen_logprob_after_training(plain)


def test_lora_dpo_reference_is_the_base_model(tokenizer, preference_records):
    model = tiny_lm(tokenizer.vocab_size)
    batch = encode_pairs(tokenizer, preference_records[:6])
    ids, mask = stack_pairs(batch)
    with torch.no_grad():
        base_logps = sequence_logprobs(model, ids, mask)
    inject_lora(model, LoraConfig(rank=4, alpha=8))
    strategy = DPOStrategy(model, beta=0.1)
    assert strategy.ref_model is None and strategy.reference.is_lora_base
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = strategy.compute_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with strategy.reference.active() as ref:
        assert torch.equal(sequence_logprobs(ref, ids, mask), base_logps)
    with torch.no_grad():
        assert not torch.allclose(sequence_logprobs(model, ids, mask), base_logps)
        with adapters_disabled(model):
            assert torch.equal(sequence_logprobs(model, ids, mask), base_logps)


def test_preference_batch_errors(tokenizer, preference_records):
    strategy = DPOStrategy(tiny_lm(tokenizer.vocab_size))
    batch = encode_pairs(tokenizer, preference_records[:3])
    without = {k: v for k, v in batch.items() if not k.startswith("rejected")}
    with pytest.raises(DataError, match="'rejected'"):
        strategy.compute_loss(without)
    empty = dict(batch, rejected_mask=batch["rejected_mask"].clone())
    empty["rejected_mask"][1] = 0
    with pytest.raises(DataError, match=r"pair\(s\) \[1\] have an empty rejected response"):
        strategy.compute_loss(empty)
    with pytest.raises(ConfigError, match="beta"):
        DPOStrategy(tiny_lm(tokenizer.vocab_size), beta=0)
    with pytest.raises(ConfigError, match="RewardModel"):
        StrategyFactory.create(tiny_lm(tokenizer.vocab_size), "rm")


def test_reward_model_held_out_accuracy_rises(tokenizer, preference_records):
    held_out = encode_pairs(tokenizer, preference_records[:300])
    train = preference_records[300:]
    rm = RewardModel.from_base(tiny_lm(tokenizer.vocab_size, dim=64))
    strategy = StrategyFactory.create(rm, "rm")

    def held_out_accuracy():
        with torch.no_grad():
            chosen, rejected = pair_scores(rm, held_out)
        return (chosen > rejected).float().mean().item()

    start = held_out_accuracy()
    opt = torch.optim.AdamW(rm.parameters(), lr=1e-3)
    batch_size = 32
    for step in range(150):
        k = (step * batch_size) % (len(train) - batch_size)
        loss = strategy.compute_loss(encode_pairs(tokenizer, train[k:k + batch_size]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = held_out_accuracy()
    print(f"reward model held-out pairwise accuracy: start {start:.3f}, end {end:.3f}")
    assert end > 0.57 and end > start + 0.05, (start, end)


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value into Python (``item()``, ``float()``): on a GPU each
    one makes the CPU wait for every kernel queued before it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("train_type,kwargs", [("dpo", {"beta": 0.1}), ("kl", {"beta": 0.5})])
def test_compute_loss_leaves_metrics_on_the_device(tokenizer, preference_records, train_type, kwargs):
    """The loss and metrics of a micro-batch are not read to the host: the trainer reads
    them once per optimizer step (``host_values``), so micro-batches queue back to back."""
    from astrai.alignment.kl import snapshot_reference
    from astrai.trainer.trainer import host_values

    torch.manual_seed(0)
    model = tiny_lm(tokenizer.vocab_size)
    strategy = StrategyFactory.create(model, train_type, **kwargs)
    if train_type == "kl":
        strategy.reference = snapshot_reference(model)
        ids = torch.randint(0, tokenizer.vocab_size, (2, 17))
        batch = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]}
    else:
        batch = encode_pairs(tokenizer, preference_records[:4])
    with HostReads() as reads:
        loss = strategy.compute_loss(batch)
        loss.backward()
    assert reads.count == 0
    metrics = host_values(strategy.metrics)
    assert metrics and all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
