"""save_pretrained / from_pretrained: exact round trips, sharding, and errors that name the file."""

import json

import pytest
import torch

from astrai.config import preset
from astrai.errors import CheckpointError
from astrai.model import AutoModel

TINY = dict(vocab_size=128, dim=64, n_layers=2, dim_ffn=128, n_heads=4, n_kv_heads=2)


def _model(**overrides):
    torch.manual_seed(0)
    return AutoModel.from_config(preset("tiny", **{**TINY, **overrides})).eval()


def _assert_same(a, b):
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("overrides", [{}, {"tie_weight": False}, {"attn_type": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                       "qk_rope_head_dim": 8, "v_head_dim": 16},
                                       {"ffn_type": "moe", "n_routed_experts": 4, "n_activated_experts": 2, "n_shared_experts": 1}],
                         ids=["tied", "untied", "mla", "moe"])
def test_save_load_round_trip_is_exact(overrides, tmp_path):
    model = _model(**overrides)
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    _assert_same(model, loaded)
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids)["logits"], loaded(ids)["logits"])
    if model.config.tie_weight:
        assert loaded.lm_head.weight is loaded.embed_tokens.weight


def test_sharded_save_round_trip(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path, max_shard_bytes=20_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    _assert_same(model, AutoModel.from_pretrained(tmp_path))
    model.save_pretrained(tmp_path)  # re-saving unsharded removes the stale shards
    assert not list(tmp_path.glob("model-*-of-*.safetensors")) and (tmp_path / "model.safetensors").is_file()


def test_load_with_dtype(tmp_path):
    _model().save_pretrained(tmp_path)
    model = AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary_embedding.inv_freq.dtype == torch.float32
    assert _model().to(torch.bfloat16).rotary_embedding.inv_freq.dtype == torch.float32


@pytest.fixture
def saved(tmp_path):
    _model().save_pretrained(tmp_path)
    return tmp_path


def test_missing_weights_file_is_named(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        AutoModel.from_pretrained(saved)


def test_pickled_weights_are_refused(saved):
    (saved / "model.safetensors").rename(saved / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only pickled weights \(\.bin/\.pt\) found"):
        AutoModel.from_pretrained(saved)


def test_missing_config_is_named(saved):
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        AutoModel.from_pretrained(saved)


def test_missing_shard_is_named(tmp_path):
    _model().save_pretrained(tmp_path, max_shard_bytes=20_000)
    victim = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: listed in .* but missing"):
        AutoModel.from_pretrained(tmp_path)


def test_wrong_shape_names_file_tensor_and_shapes(saved):
    config = json.loads((saved / "config.json").read_text())
    config["dim_ffn"] = 96
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'layers\.0\.mlp\.\w+\.weight' has shape"):
        AutoModel.from_pretrained(saved)


def test_unknown_model_type_is_named(saved):
    config = json.loads((saved / "config.json").read_text())
    config["model_type"] = "gpt9"
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown model_type 'gpt9'; known: .*llama"):
        AutoModel.from_pretrained(saved)


def test_corrupt_safetensors_is_named(saved):
    path = saved / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors file"):
        AutoModel.from_pretrained(saved)


def test_missing_and_unexpected_tensors_are_named(saved):
    from safetensors.torch import load_file, save_file

    state = load_file(saved / "model.safetensors")
    state["layers.9.extra.weight"] = state.pop("norm.weight")
    save_file(state, saved / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"weights missing for norm\.weight"):
        AutoModel.from_pretrained(saved)


def test_invalid_json_and_bad_field_are_named(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        AutoModel.from_pretrained(saved)
    (saved / "config.json").write_text(json.dumps({**TINY, "n_kv_heads": 3}))
    with pytest.raises(CheckpointError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        AutoModel.from_pretrained(saved)


def test_unsupported_hf_feature_is_refused(tmp_path):
    hf = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
          "num_attention_heads": 4, "hidden_act": "gelu"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config\.json: hidden_act 'gelu' is not supported"):
        AutoModel.from_pretrained(tmp_path)
    hf.update(hidden_act="silu", rope_scaling={"rope_type": "longrope", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"rope type 'longrope' is not supported"):
        AutoModel.from_pretrained(tmp_path)
    hf.update(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config\.json: rope scaling is missing 'original_max_position_embeddings'"):
        AutoModel.from_pretrained(tmp_path)
