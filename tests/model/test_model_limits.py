"""The model refuses inputs past its limits instead of computing a silently different answer."""

import pytest
import torch
import transformers

from astrai.config import preset
from astrai.errors import DataError
from astrai.model import AutoModel

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def test_forward_longer_than_max_len_is_refused():
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                         dim_ffn=64, max_len=16))
    assert model(torch.zeros(1, 16, dtype=torch.long))["logits"].shape == (1, 16, 64)
    with pytest.raises(DataError, match=r"17 positions .* max_len \(16\)"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_window_import_is_capped_at_the_window(family, tmp_path):
    """Within the window full attention equals sliding-window attention; past it the model refuses."""
    model_cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    torch.manual_seed(0)
    config = config_cls(**SHAPE, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    reference = model_cls(config).eval()
    reference.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path).eval()
    assert ours.config.max_len == 32
    ids = torch.randint(0, 128, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids[:, :32])["logits"], reference(ids[:, :32]).logits, rtol=0, atol=1e-4)
        beyond = reference(ids).logits[:, 32:]
        full_attention = model_cls(config_cls(**SHAPE)).eval()
        full_attention.load_state_dict(reference.state_dict())
        assert not torch.allclose(full_attention(ids).logits[:, 32:], beyond, atol=1e-3)  # the window matters there
        with pytest.raises(DataError, match="max_len"):
            ours(ids)
