"""Parity with transformers: HF checkpoints imported into astrai, astrai models exported to HF."""

import json

import pytest
import torch
import transformers

from astrai.config import preset
from astrai.model import AutoModel
from astrai.model.hf import export_llama

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

CASES = {
    "llama-gqa-untied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "llama-tied-llama3-rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                               {"tie_word_embeddings": True, "rope_scaling": LLAMA3}),
    "llama-yarn-rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {"rope_scaling": YARN}),
    "llama-linear-rope-mha": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                              {"num_key_value_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2-bias-tied": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3-qknorm-headdim": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"head_dim": 32}),
    "qwen3-tied": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"tie_word_embeddings": True}),
}


def _randomize_biases_and_norms(model: torch.nn.Module) -> None:
    """HF initialises biases to 0 and norms to 1; make them random so a dropped one would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)


def _greedy(step, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        ids = torch.cat([ids, step(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("case", sorted(CASES))
def test_imported_hf_checkpoint_matches_transformers(case, tmp_path):
    model_cls, config_cls, extra = CASES[case]
    torch.manual_seed(0)
    reference = model_cls(config_cls(**{**SHAPE, **extra})).eval()
    _randomize_biases_and_norms(reference)
    reference.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, 48))
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids)["logits"]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        prompt = ids[:, :8]
        assert torch.equal(_greedy(lambda x: ours(x)["logits"], prompt, 8),
                           _greedy(lambda x: reference(x).logits, prompt, 8))


def test_mistral_import_caps_max_len_at_sliding_window(tmp_path):
    torch.manual_seed(0)
    reference = transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=32)).eval()
    reference.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path).eval()
    assert ours.config.max_len == 32
    ids = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)["logits"], reference(ids).logits, rtol=0, atol=1e-4)


def test_sharded_hf_checkpoint_imports(tmp_path):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = AutoModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)["logits"], reference(ids).logits, rtol=0, atol=1e-4)


EXPORTS = {
    "llama-tied": dict(),
    "llama-untied-yarn": dict(tie_weight=False, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_len": 64}),
    "qwen3-qknorm": dict(use_qk_norm=True, head_dim=32),
    "qwen2-bias-llama3": dict(attn_bias=True, rope_scaling={"type": "llama3", "factor": 8.0, "original_max_len": 32}),
}


@pytest.mark.parametrize("case", sorted(EXPORTS))
def test_exported_model_loads_in_transformers_with_same_logits(case, tmp_path):
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=128, dim=64, n_layers=2, dim_ffn=128, n_heads=4, n_kv_heads=2, **EXPORTS[case])
    ours = AutoModel.from_config(cfg).eval()
    _randomize_biases_and_norms(ours)
    ours.save_pretrained(tmp_path, format="hf")
    family = json.loads((tmp_path / "config.json").read_text())["model_type"]
    assert family == case.split("-")[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits, ours(ids)["logits"], rtol=0, atol=1e-4)
    assert reference.config.eos_token_id is None  # not Llama's default 2
    back = AutoModel.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))


def test_export_writes_given_token_ids(tmp_path):
    from astrai.model.hf import export_hf

    model = AutoModel.from_config(preset("tiny", vocab_size=128, dim=64, n_layers=1, dim_ffn=128))
    export_hf(model, tmp_path, token_ids={"bos_token_id": 1, "eos_token_id": 3})
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 3, None)


def test_export_llama_refuses_what_llama_cannot_express(tmp_path):
    from astrai.errors import ConfigError

    mla = AutoModel.from_config(preset("tiny-mla", vocab_size=128, dim=64, n_layers=1, dim_ffn=128, kv_lora_rank=16,
                                       qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16))
    with pytest.raises(ConfigError, match="only dense GQA"):
        export_llama(mla, tmp_path)
    qk = AutoModel.from_config(preset("tiny", vocab_size=128, dim=64, n_layers=1, dim_ffn=128, use_qk_norm=True))
    with pytest.raises(ConfigError, match="use format 'qwen3'"):
        export_llama(qk, tmp_path)
