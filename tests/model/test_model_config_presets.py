"""ModelConfig: presets validate, the 1b preset's size, JSON round trip and validate() messages."""

import pytest
import torch

from astrai.config import PRESETS, ModelConfig, preset
from astrai.errors import ConfigError
from astrai.model import AutoModel


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_build_on_meta(name):
    cfg = preset(name)
    assert cfg.validate() is cfg
    with torch.device("meta"):
        model = AutoModel.from_config(cfg)
    assert model.num_parameters() > 0


def test_1b_preset_counts_about_one_billion_parameters_without_allocating():
    with torch.device("meta"):
        model = AutoModel.from_config(preset("1b"))
    assert next(model.parameters()).device.type == "meta"
    assert 0.95e9 <= model.num_parameters() <= 1.1e9


def test_small_preset_is_30_to_60m():
    with torch.device("meta"):
        assert 30e6 <= AutoModel.from_config(preset("small")).num_parameters() <= 60e6


def test_json_round_trip(tmp_path):
    cfg = preset("tiny-moe", rope_scaling={"type": "yarn", "factor": 4.0, "original_max_len": 256})
    cfg.save(tmp_path / "c.json")
    assert ModelConfig.load(tmp_path / "c.json") == cfg


@pytest.mark.parametrize("overrides, message", [
    ({"n_heads": 4, "n_kv_heads": 3}, r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
    ({"attn_type": "flash"}, r"unknown attn_type 'flash'; choose one of gqa, mla"),
    ({"ffn_type": "kan"}, r"unknown ffn_type 'kan'"),
    ({"dim": 250}, r"dim \(250\) must be divisible by n_heads \(4\)"),
    ({"vocab_size": 0}, r"vocab_size must be a positive integer, got 0"),
    ({"attn_type": "mla"}, r"attn_type 'mla' needs kv_lora_rank > 0"),
    ({"ffn_type": "moe"}, r"ffn_type 'moe' needs n_routed_experts > 0"),
    ({"ffn_type": "moe", "n_routed_experts": 4, "n_activated_experts": 5}, r"n_activated_experts \(5\) must be in 1..n_routed_experts \(4\)"),
    ({"ffn_type": "moe", "n_routed_experts": 4, "n_activated_experts": 2, "moe_topk_method": "best"}, r"unknown moe_topk_method 'best'"),
    ({"rope_scaling": {"type": "ntk2", "factor": 2.0}}, r"unknown rope_scaling type 'ntk2'"),
    ({"rope_scaling": {"type": "linear", "factor": 0.5}}, r"rope_scaling factor must be a number >= 1"),
    ({"head_dim": 33}, r"head_dim \(33\) must be even"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
     r"rope_scaling type 'yarn' does not use original_max_position_embeddings; known keys: .*original_max_len"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     r"high_freq_factor \(1.0\) > low_freq_factor \(4.0\)"),
])
def test_validate_names_the_field_and_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        preset("tiny", **overrides)


def test_unknown_field_and_preset_are_named():
    with pytest.raises(ConfigError, match=r"unknown ModelConfig field\(s\): hiden_size"):
        ModelConfig.from_dict({"hiden_size": 3})
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'; choose one of tiny"):
        preset("huge")
