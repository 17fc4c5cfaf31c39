"""Optimisers, precision, gradient checkpointing, token budgets, mixtures and metric records."""

import json
from collections import Counter

import pytest
import torch
from trainer_helpers import VOCAB, TokenWindows, config, tiny_model

from astrai.config import TrainConfig, preset
from astrai.model import AutoModel
from astrai.serialization import Checkpoint, latest_checkpoint
from astrai.trainer import TrainCallback, Trainer
from astrai.trainer.mixture import MixtureSampler
from astrai.trainer.optimizers import CombinedOptimizer, build_optimizer, split_parameters


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = tiny_model(attn_bias=True)
    groups = split_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]}
    decay = {names[id(p)] for p in groups["decay"]}
    assert "embed_tokens.weight" in no_decay and any("norm" in n for n in no_decay)
    assert any(n.endswith("bias") for n in no_decay)
    assert all(n.endswith("weight") and "norm" not in n and "embed" not in n for n in decay)
    opt = build_optimizer(model, TrainConfig(adamw_weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_embedding_lr_scale_gives_the_embedding_its_own_rate_through_the_schedule(tmp_path):
    model = tiny_model()
    opt = build_optimizer(model, TrainConfig(max_lr=1e-3, embedding_lr_scale=4.0))
    table = [g for g in opt.param_groups if any(p is model.embed_tokens.weight for p in g["params"])]
    assert len(table) == 1 and table[0]["params"] == [model.embed_tokens.weight]
    assert table[0]["lr"] == pytest.approx(4e-3) and table[0]["weight_decay"] == 0.0
    assert all(g["lr"] == 1e-3 for g in opt.param_groups if g is not table[0])
    assert len(build_optimizer(model, TrainConfig()).param_groups) == 2  # unscaled: the usual two groups

    class Rates(TrainCallback):
        rates = []

        def on_optimizer_step(self, context):
            groups = context.optimizer.param_groups
            self.rates.append([g["lr"] for g in groups if g["params"] == [context.model.embed_tokens.weight]]
                              + [groups[0]["lr"]])

    cfg = config(tmp_path, max_steps=6, embedding_lr_scale=4.0, max_lr=1e-3, schedule="cosine", warmup_ratio=0.0,
                 save_final_model=False)
    Trainer(cfg, model=tiny_model(), train_dataset=TokenWindows(), callbacks=[Rates()]).train()
    assert len(Rates.rates) == 6 and all(len(r) == 2 for r in Rates.rates)
    assert all(embedding == pytest.approx(4 * dense) for embedding, dense in Rates.rates)
    assert Rates.rates[-1][1] < Rates.rates[0][1]  # the schedule moves both
    with pytest.raises(Exception, match="embedding_lr_scale"):
        TrainConfig(embedding_lr_scale=0.0).validate()


def test_embedding_weight_decay_shrinks_the_table_and_only_the_table():
    torch.manual_seed(0)
    model = tiny_model()
    opt = build_optimizer(model, TrainConfig(max_lr=1e-2, embedding_weight_decay=0.5))
    table = [g for g in opt.param_groups if g["params"] == [model.embed_tokens.weight]]
    assert len(table) == 1 and table[0]["weight_decay"] == 0.5 and table[0]["lr"] == pytest.approx(1e-2)
    norms = [p for g in opt.param_groups if g is not table[0] and g["weight_decay"] == 0.0 for p in g["params"]]
    assert norms and all(p is not model.embed_tokens.weight for p in norms)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    for p in model.parameters():  # no gradient: AdamW's step is then the decay alone
        p.grad = torch.zeros_like(p)
    opt.step()
    table_weight = model.embed_tokens.weight
    assert torch.allclose(table_weight, before[id(table_weight)] * (1 - 1e-2 * 0.5))
    assert all(torch.equal(p, before[id(p)]) for p in norms)
    with pytest.raises(Exception, match="embedding_weight_decay"):
        TrainConfig(embedding_weight_decay=-0.1).validate()


def test_muon_option_trains_and_resumes(tmp_path):
    cfg = config(tmp_path, optimizer="muon", max_steps=4, ckpt_interval=2, save_final_model=False)
    context = Trainer(cfg, model=tiny_model(), train_dataset=TokenWindows()).train()
    assert isinstance(context.optimizer, CombinedOptimizer)
    assert isinstance(context.optimizer.optimizers[0], torch.optim.Muon)
    ckpt = Checkpoint.load(latest_checkpoint(tmp_path / "ckpt"))
    resumed = Trainer(cfg, model=tiny_model(), train_dataset=TokenWindows())._build_context(ckpt)
    assert resumed.step == 4
    for a, b in zip(resumed.optimizer.optimizers, context.optimizer.optimizers):
        assert a.state_dict()["param_groups"][0]["lr"] == b.state_dict()["param_groups"][0]["lr"]


def test_bf16_autocast_keeps_fp32_master_weights(tmp_path):
    cfg = config(tmp_path, precision="bf16", max_steps=2, save_final_model=False)
    context = Trainer(cfg, model=tiny_model(), train_dataset=TokenWindows()).train()
    assert context.autocast_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in context.model.parameters())
    assert all(v.dtype == torch.float32 for s in context.optimizer.state.values() for k, v in s.items()
               if k.startswith("exp_avg"))
    assert torch.isfinite(torch.tensor(context.loss))


class Grads(TrainCallback):
    def on_optimizer_step(self, context):
        self.grads = [p.grad.clone() for p in context.model.parameters()]


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    results = []
    for enabled in (False, True):
        grads = Grads()
        cfg = config(tmp_path / str(enabled), gradient_checkpointing=enabled, max_steps=1, save_final_model=False)
        Trainer(cfg, callbacks=[grads], model=tiny_model(), train_dataset=TokenWindows()).train()
        results.append(grads.grads)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_token_budget_sets_steps_and_wsd_schedule(tmp_path):
    cfg = config(tmp_path, total_tokens=10 * 2 * 16, n_epoch=99, schedule="wsd", warmup_ratio=0.2, decay_ratio=0.3,
                 min_rate=0.0, save_final_model=False)
    lrs = []

    class Lr(TrainCallback):
        def on_optimizer_step(self, context):
            lrs.append(context.lr)

    context = Trainer(cfg, callbacks=[Lr()], model=tiny_model(), train_dataset=TokenWindows(n=8)).train()
    assert context.total_steps == 10 and context.step == 10 and context.tokens_seen == 320
    assert context.epoch >= 2  # the budget, not n_epoch, ended the run (4 steps per epoch here)
    assert lrs[2] == lrs[6] == pytest.approx(1e-2) and lrs[9] == pytest.approx(1e-2 * (1 - 2 / 3))


def test_mixture_sampler_follows_rates_shards_ranks_and_resumes():
    sampler = MixtureSampler([100, 1000], [0.8, 0.2], seed=3)
    order = list(sampler)
    share = Counter(i < 100 for i in order)
    assert abs(share[True] / len(order) - 0.8) < 0.05
    sampler.set_epoch(0, start=500)
    assert list(sampler) == order[500:]
    ranks = [list(MixtureSampler([40], seed=1, rank=r, world_size=2)) for r in range(2)]
    assert not set(ranks[0]) & set(ranks[1]) and len(ranks[0]) == len(ranks[1]) == 20
    sampler.set_epoch(1)
    assert list(sampler) != order


def test_metric_records_have_grad_norm_router_stats_and_val_loss(tmp_path):
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny-moe", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                         dim_ffn=64, moe_dim_ffn=16, max_len=64))
    norms = []

    class Norm(TrainCallback):
        def on_step_end(self, context):
            norms.append(context.grad_norm)

    cfg = config(tmp_path, max_steps=4, val_fraction=0.25, validation_interval=2, max_grad_norm=0.5,
                 save_final_model=False)
    Trainer(cfg, callbacks=[Norm()], model=model, train_dataset=TokenWindows()).train()
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["grad_norm"] for r in records] == norms and len(set(norms)) == 4
    assert ["val_loss" in r for r in records] == [False, True, False, True]
    assert set(records[0]["router"]) == {"layer1"} and sum(records[0]["router"]["layer1"]) == pytest.approx(1.0, abs=1e-3)
    assert all(r["tokens_per_s"] > 0 and r["tokens"] == r["step"] * 32 for r in records)


def test_exception_mid_step_leaves_an_emergency_checkpoint_of_the_last_step(tmp_path):
    class Boom(TrainCallback):
        def on_batch_begin(self, context):
            if context.step == 3:
                raise RuntimeError("boom")

    cfg = config(tmp_path, max_steps=6, ckpt_interval=100, grad_accum_steps=2, save_final_model=False)
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(cfg, callbacks=[Boom()], model=tiny_model(), train_dataset=TokenWindows()).train()
    ckpt = Checkpoint.load(latest_checkpoint(tmp_path / "ckpt"))
    assert ckpt.meta["step"] == 3 and ckpt.extra["trainer_state"]["batch_in_epoch"] == 6
