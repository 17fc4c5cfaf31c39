"""--kv-cache-dtype on generate, chat and serve: the engine's KV cache takes the dtype asked
for; the flag offers exactly the dtypes the engine accepts."""

import io

import pytest
import torch

from astrai.cli import main
from astrai.commands.engine import KV_CACHE_DTYPES
from astrai.inference.cache.storage import KV_CACHE_DTYPES as ENGINE_KV_CACHE_DTYPES
from astrai.inference.engine import InferenceEngine

from inference_helpers import make_model


@pytest.fixture
def model_dir(tokenizer, tmp_path):
    path = tmp_path / "m"
    make_model("tiny", seed=5, vocab_size=tokenizer.vocab_size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def cache_dtypes(monkeypatch):
    """The KV cache dtype of every engine made."""
    seen = []
    original = InferenceEngine.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self.scheduler.page_cache.storage.k_cache.dtype)

    monkeypatch.setattr(InferenceEngine, "__init__", recording_init)
    return seen


def test_the_flag_offers_the_engines_dtypes():
    assert KV_CACHE_DTYPES == tuple(ENGINE_KV_CACHE_DTYPES)


def test_generate_takes_the_kv_cache_dtype(model_dir, cache_dtypes):
    for flag, dtype in ((["--kv-cache-dtype", "bfloat16"], torch.bfloat16), ([], torch.float32)):
        assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2", "--device", "cpu",
                     *flag]) == 0
        assert cache_dtypes[-1] == dtype


def test_chat_takes_the_kv_cache_dtype(model_dir, cache_dtypes, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(model_dir), "--max-tokens", "2", "--device", "cpu",
                 "--kv-cache-dtype", "float16"]) == 0
    assert cache_dtypes == [torch.float16]


def test_serve_passes_the_kv_cache_dtype_and_refuses_others(monkeypatch, tmp_path, capsys):
    from astrai.serving import launch

    seen = {}
    monkeypatch.setattr(launch, "run_server", lambda model_dir, **kwargs: seen.update(kwargs))
    assert main(["serve", "--model", str(tmp_path), "--kv-cache-dtype", "bfloat16"]) == 0
    assert seen["kv_cache_dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tmp_path), "--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
