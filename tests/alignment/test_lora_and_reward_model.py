"""LoRA injection/merge/save and the reward model's head, on tiny random models."""

import json

import pytest
import torch

from astrai.config import preset
from astrai.errors import CheckpointError, ConfigError
from astrai.model import AutoModel
from astrai.model.lora import (LoraConfig, adapters_disabled, has_lora, inject_lora, load_adapter, lora_state_dict,
                               merge_lora, save_adapter)
from astrai.model.reward import RewardModel


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = preset("tiny", vocab_size=64, n_layers=2, dim=32, n_heads=2, n_kv_heads=1, dim_ffn=64, max_len=64, **overrides)
    return AutoModel.from_config(cfg)


def perturb_adapters(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.05)


def test_only_adapters_train_and_change():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = inject_lora(model, LoraConfig(rank=4, alpha=8, targets=["q_proj", "v_proj", "up"]))
    assert len(names) == 6
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 64, (2, 10))
    for _ in range(2):
        loss = model(ids)["logits"].logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in lora_state_dict(model).items() if k.endswith("lora_B"))


def test_fresh_adapters_are_identity_and_disabling_gives_base():
    model = tiny_model()
    ids = torch.randint(0, 64, (2, 9))
    base = model(ids)["logits"]
    inject_lora(model, LoraConfig(rank=2, alpha=4))
    assert torch.equal(model(ids)["logits"], base)
    perturb_adapters(model)
    assert not torch.allclose(model(ids)["logits"], base)
    with adapters_disabled(model):
        assert torch.equal(model(ids)["logits"], base)
    assert not torch.allclose(model(ids)["logits"], base)


def test_merged_logits_equal_base_plus_adapter(tmp_path):
    model = tiny_model()
    inject_lora(model, LoraConfig(rank=4, alpha=16, targets=["q_proj", "o_proj", "down"]))
    perturb_adapters(model)
    ids = torch.randint(0, 64, (2, 11))
    adapted = model(ids)["logits"].detach()
    save_adapter(model, tmp_path / "adapter")
    merge_lora(model)
    assert not has_lora(model)
    torch.testing.assert_close(model(ids)["logits"], adapted, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path / "merged")
    reloaded = AutoModel.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(reloaded(ids)["logits"], adapted, atol=1e-5, rtol=1e-5)


def test_adapter_save_load_round_trip(tmp_path):
    model = tiny_model()
    inject_lora(model, LoraConfig(rank=3, alpha=6, targets=["k_proj"]))
    perturb_adapters(model)
    ids = torch.randint(0, 64, (1, 7))
    expected = model(ids)["logits"]
    out = save_adapter(model, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((tmp_path / "adapter_config.json").read_text())["rank"] == 3
    fresh = load_adapter(tiny_model(), tmp_path)
    assert torch.equal(fresh(ids)["logits"], expected)
    other = tiny_model()
    inject_lora(other, LoraConfig(rank=3, alpha=6, targets=["q_proj"]))
    with pytest.raises(CheckpointError, match="adapter names"):
        load_adapter(other, tmp_path)


def test_lora_config_errors():
    with pytest.raises(ConfigError, match="qproj"):
        inject_lora(tiny_model(), LoraConfig(targets=["qproj"]))
    with pytest.raises(ConfigError, match="lora_rank"):
        inject_lora(tiny_model(), LoraConfig(rank=0))


def test_reward_model_reads_last_real_token_and_round_trips(tmp_path):
    base = tiny_model()
    rm = RewardModel.from_base(base)
    assert rm.config.model_type == "reward"
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    padded = ids.clone()
    padded[1, 5:] = 0
    scores = rm.score(padded, mask)
    alone = rm.score(ids[1:, :5])
    assert scores[1].item() == pytest.approx(alone.item(), abs=1e-5)
    assert scores.shape == (2,)
    rm.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(reloaded, RewardModel)
    torch.testing.assert_close(reloaded.score(padded, mask), scores)
