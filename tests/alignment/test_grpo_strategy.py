"""GRPO with the inference engine on the bundled arithmetic task, plus its error messages."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from astrai.alignment.grpo import GRPOScheduleCallback, GRPOStrategy, rollout_dtype
from astrai.alignment.losses import shifted_token_logprobs
from astrai.alignment.rewards import arithmetic_reward, resolve_reward
from astrai.alignment.rollout import pack_sequences
from astrai.dataset.arithmetic import make_problems
from astrai.errors import ConfigError, DataError
from astrai.trainer.strategies import StrategyFactory

from alignment_helpers import tiny_lm


def sft(model, tokenizer, problems, steps, lr=3e-3, seed=1):
    """A short supervised warm-up: prompt "3+4=" → answer "7" and end-of-sequence."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        batch = [rng.choice(problems) for _ in range(32)]
        ids, mask = pack_sequences([tokenizer.encode(p["prompt"]) for p in batch],
                                   [tokenizer.encode(p["answer"]) + [tokenizer.eos_id] for p in batch])
        logp = shifted_token_logprobs(model, ids)
        weights = mask[:, 1:].float()
        loss = -(logp * weights).sum() / weights.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_online_grpo_raises_mean_reward_on_arithmetic(tokenizer):
    """Short SFT, then 100 GRPO steps with engine rollouts; mean sampled reward on a fixed evaluation
    draw of problems (never used for a gradient) rises. Single-digit addition has only 100 problems, so
    the evaluation draw overlaps with the problems GRPO trains on."""
    all_problems = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    model = tiny_lm(tokenizer.vocab_size, dim=64)
    # 100 GRPO steps: with half as many the gain over SFT depends on the SFT seed and moves with
    # rounding changes in the model; with 100 it is positive for every seed tried.
    sft(model, tokenizer, all_problems, steps=300)
    strategy = GRPOStrategy(model, group_size=8, reward="arithmetic", tokenizer=tokenizer, max_new_tokens=4,
                            temperature=1.0, seed=0)
    evaluation = [tokenizer.encode(p["prompt"]) for p in make_problems(80, seed=123)]
    train_prompts = [tokenizer.encode(p["prompt"]) for p in make_problems(1600, seed=7)]
    try:
        start = strategy.mean_reward(evaluation)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rewards = []
        for step in range(100):
            loss = strategy.compute_loss({"prompts": train_prompts[16 * step:16 * (step + 1)]})
            opt.zero_grad()
            loss.backward()
            opt.step()
            strategy.after_optimizer_step()
            rewards.append(strategy.metrics["reward_mean"])
        end = strategy.mean_reward(evaluation)
    finally:
        strategy.close()
    print(f"GRPO evaluation mean reward: start {start:.3f}, end {end:.3f}; training reward "
          f"{sum(rewards[:5]) / 5:.3f} → {sum(rewards[-5:]) / 5:.3f}")
    for key in ("reward_std", "kl", "clip_fraction", "response_length", "rollout_s", "scoring_s"):
        assert math.isfinite(strategy.metrics[key])
    assert end > start + 0.05, (start, end, rewards)


def test_engine_weights_and_reference_follow_the_schedule(tokenizer):
    model = tiny_lm(tokenizer.vocab_size)
    strategy = GRPOStrategy(model, group_size=2, reward=lambda p, r: float(len(r)), tokenizer=tokenizer,
                            max_new_tokens=3, sync_interval=2, weight_sync_interval=1)
    try:
        engine_model = strategy.rollout.engine.model
        ref_before = {k: v.clone() for k, v in strategy.ref_model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        strategy.after_optimizer_step()
        for name, tensor in model.state_dict().items():
            assert torch.equal(engine_model.state_dict()[name], tensor), name
        assert all(torch.equal(v, ref_before[k]) for k, v in strategy.ref_model.state_dict().items())
        strategy.after_optimizer_step()
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in strategy.ref_model.state_dict().items())
    finally:
        strategy.close()


def test_rollout_engine_follows_the_runs_autocast_dtype_on_gpus(tokenizer):
    """The engine samples on its own thread, outside the trainer's thread-local autocast, so a bf16 run
    on a GPU gives it a bf16 weight copy; on the CPU it keeps fp32 (its decode kernels are fp32-only)."""
    assert rollout_dtype(torch.bfloat16, torch.device("cuda", 0)) is torch.bfloat16
    assert rollout_dtype(torch.bfloat16, torch.device("cpu")) is None
    assert rollout_dtype(None, torch.device("cuda", 0)) is None
    model = tiny_lm(tokenizer.vocab_size)
    strategy = GRPOStrategy(model, group_size=2, reward=lambda p, r: 1.0, tokenizer=tokenizer, max_new_tokens=3)
    callback = GRPOScheduleCallback(strategy)
    callback.on_train_begin(SimpleNamespace(tokenizer=tokenizer, autocast_dtype=torch.bfloat16,
                                            device=torch.device("cuda", 0)))
    try:
        engine_model = strategy.rollout.engine.model  # built on the CPU here; the dtype is what is checked
        assert {p.dtype for p in engine_model.parameters()} == {torch.bfloat16}
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the policy keeps fp32 master weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        strategy.after_optimizer_step()
        for name, tensor in model.state_dict().items():
            assert torch.equal(engine_model.state_dict()[name], tensor.to(torch.bfloat16)), name
        rollout, rewards, _ = strategy.sample([tokenizer.encode("3+4=")])
        assert rollout.response_mask.sum() > 0 and rewards.tolist() == [1.0, 1.0]
    finally:
        strategy.close()


def test_offline_grpo_groups_rows_by_prompt():
    model = tiny_lm(64)
    strategy = GRPOStrategy(model, group_size=2, kl_coef=0.01)
    batch = {"prompts": torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]]),
             "prompt_mask": torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]]),
             "responses": torch.tensor([[1, 2, 0], [3, 0, 0], [4, 4, 4]]),
             "masks": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]),
             "rewards": torch.tensor([1.0, 0.0, 5.0])}
    loss = strategy.compute_loss(batch)
    loss.backward()
    # the reference is a snapshot of these very weights (in eval mode its last block computes the
    # scored positions alone, whose products may round apart from the policy's in the last bits)
    assert strategy.metrics["kl"] < 1e-10
    assert strategy.metrics["reward_mean"] == pytest.approx(2.0)
    # the lone third row gets advantage 0; the pair gets ±1, each averaged over its own tokens
    assert loss.item() == pytest.approx(-(1.0 - 1.0) / 3, abs=1e-6)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with pytest.raises(DataError, match=r"row\(s\) \[1\]"):
        strategy.compute_loss(dict(batch, rewards=torch.tensor([1.0, float("nan"), 0.0])))


def test_grpo_without_kl_builds_and_runs_no_reference():
    """kl_coef 0: no reference copy is held and no step runs one; the loss is the policy term."""
    torch.manual_seed(0)
    model = tiny_lm(64)
    batch = {"prompts": torch.tensor([[5, 6], [5, 6]]), "responses": torch.tensor([[1, 2], [3, 0]]),
             "masks": torch.tensor([[1, 1], [1, 0]]), "rewards": torch.tensor([1.0, 0.0])}
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    strategy = GRPOStrategy(model, group_size=2, kl_coef=0.0)
    assert strategy.reference is None and strategy.ref_model is None
    strategy.compute_loss(batch).backward()
    assert len(calls) == 1 and "kl" not in strategy.metrics
    grads = [p.grad.clone() for p in model.parameters()]
    # the same gradient as with a reference equal to the policy, whose KL term's gradient is zero
    model.zero_grad()
    with_kl = GRPOStrategy(model, group_size=2, kl_coef=0.01)
    calls.clear()
    with_kl.compute_loss(batch).backward()
    # the reference copy carries the hook: a policy and a reference pass
    assert len(calls) == 2 and with_kl.ref_model is not None and "kl" in with_kl.metrics
    assert any(g.abs().sum() > 0 for g in grads)
    assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(grads, model.parameters()))
    strategy.after_optimizer_step()
    resumed = GRPOStrategy(tiny_lm(64), group_size=2, kl_coef=0.0)
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.steps == 1 and resumed.reference is None
    # a reference given with kl_coef 0 would be ignored: the contradiction is an error, not silence
    with pytest.raises(ConfigError, match=r"ref_path 'ref-dir'\) is only used by the KL term"):
        GRPOStrategy(model, group_size=2, kl_coef=0.0, ref_path="ref-dir")
    with pytest.raises(ConfigError, match="ref_model"):
        GRPOStrategy(model, group_size=2, kl_coef=0.0, ref_model=tiny_lm(64))


def test_grpo_without_kl_runs_only_the_rows_with_an_advantage():
    """kl_coef 0: rows of advantage 0 (a group whose answers scored alike) are left out of the
    forward and backward passes, and the loss and gradient are those of every row."""
    torch.manual_seed(0)
    prompts = [[5, 6, 7]] * 2 + [[8, 9]] * 2 + [[10, 11, 12]] * 2
    responses = [[1, 2], [3, 4], [2, 2], [4, 1], [6, 7], [7]]
    rewards = torch.tensor([1.0, 0.0, 0.1, 0.1, 0.5, 0.0])  # the middle group scored alike
    model = tiny_lm(64)
    rows_seen = []
    model.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    strategy = GRPOStrategy(model, group_size=2, kl_coef=0.0, share_prompts=False)
    ids, mask = pack_sequences(prompts, responses)
    loss = strategy.policy_loss(ids, mask, rewards)
    loss.backward()
    assert rows_seen == [4] and strategy.metrics["rows_scored"] == pytest.approx(4 / 6)
    assert strategy.metrics["response_length"].item() == pytest.approx(11 / 6)
    grads = [p.grad.clone() for p in model.parameters()]
    # every row run: the same loss and gradient (the left-out rows' terms are exactly zero)
    model.zero_grad()
    logp = shifted_token_logprobs(model, ids)
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, -1.0])
    expected = -(advantages.unsqueeze(1) * torch.exp(logp - logp.detach()) * mask[:, 1:]).sum(1) / mask[:, 1:].sum(1)
    expected.mean().backward()
    assert loss.item() == pytest.approx(expected.mean().item(), abs=1e-6)
    assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(grads, model.parameters()))
    # nothing to learn from: one row still runs (a rank with no forward would stall the others)
    rows_seen.clear()
    model.zero_grad()
    strategy.policy_loss(ids, mask, torch.full((6,), 0.1)).backward()
    assert rows_seen == [1] and all(p.grad is None or p.grad.abs().sum() == 0 for p in model.parameters())
    # with the KL term every row counts and runs
    rows_seen.clear()
    GRPOStrategy(model, group_size=2, kl_coef=0.01, share_prompts=False).policy_loss(ids, mask, rewards)
    assert rows_seen[0] == 6


def test_grpo_bad_settings_and_rewards(tokenizer):
    model = tiny_lm(tokenizer.vocab_size)
    with pytest.raises(ConfigError, match="group_size must be an integer >= 2"):
        StrategyFactory.create(model, "grpo", group_size=1)
    with pytest.raises(ConfigError, match="cannot import"):
        resolve_reward("no_such_module_xyz:score")
    with pytest.raises(ConfigError, match="expected 'arithmetic'"):
        resolve_reward("nonsense")

    def explode(prompt, response):
        raise ValueError("boom")

    prompts = [tokenizer.encode("1+2=")]
    for reward, message in ((explode, r"reward '.*explode' raised ValueError: boom on sample 0"),
                            (lambda p, r: float("nan"), r"returned nan for sample 0")):
        strategy = GRPOStrategy(model, group_size=2, reward=reward, tokenizer=tokenizer, max_new_tokens=2)
        try:
            with pytest.raises(DataError, match=message):
                strategy.compute_loss({"prompts": prompts})
        finally:
            strategy.close()


def test_arithmetic_reward_reads_the_problem_from_the_prompt():
    assert arithmetic_reward("3+4=", "7") == 1.0
    assert arithmetic_reward("<|im_start|>user\n9-3=<|im_end|>\n<|im_start|>assistant\n", " 6.") == 1.0
    assert arithmetic_reward("3*4=", "13") == 0.0
    assert arithmetic_reward("3+4=", "3+4=7, so 7") == 1.0  # the last integer stated is the answer
    assert arithmetic_reward("3+4=", "7, or 8") == 0.0
    with pytest.raises(DataError, match="no 'a\\+b' style problem"):
        arithmetic_reward("hello", "7")


def test_grpo_scores_with_a_trained_reward_model_directory(tokenizer, tmp_path):
    from astrai.model.reward import RewardModel

    rm = RewardModel.from_base(tiny_lm(tokenizer.vocab_size, seed=5))
    rm.save_pretrained(tmp_path / "rm")
    reward = resolve_reward(str(tmp_path / "rm"))
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 0, 0]])
    with torch.no_grad():
        expected = [rm.score(ids[:1, :4]).item(), rm.score(ids[1:, :3]).item()]
    assert reward(["p", "p"], ["a", "b"], ids, mask) == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ConfigError, match="not a reward model"):
        tiny_lm(tokenizer.vocab_size).save_pretrained(tmp_path / "lm")
        resolve_reward(str(tmp_path / "lm"))
    strategy = GRPOStrategy(tiny_lm(tokenizer.vocab_size), group_size=2, reward=str(tmp_path / "rm"),
                            tokenizer=tokenizer, max_new_tokens=3)
    try:
        loss = strategy.compute_loss({"prompts": [tokenizer.encode("2+2=")]})
        assert math.isfinite(loss.item()) and strategy.metrics["reward_std"] > 0
    finally:
        strategy.close()
