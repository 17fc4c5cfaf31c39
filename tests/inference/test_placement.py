"""--device/--dtype: auto picks a visible GPU and bf16 where it is native, the CPU and the saved dtype
otherwise; impossible choices are refused by name; generate, chat and serve all take the flags."""

import json

import pytest
import torch

from astrai.cli import main
from astrai.errors import ConfigError
from astrai.inference.placement import resolve_device, resolve_dtype, resolve_placement

from inference_helpers import make_model


def pretend_gpus(monkeypatch, count: int, bf16: bool):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)


def test_auto_on_a_cpu_machine_keeps_the_cpu_and_the_saved_dtype(monkeypatch):
    pretend_gpus(monkeypatch, 0, False)
    assert resolve_placement("auto", "auto") == (torch.device("cpu"), None)
    assert resolve_placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)


def test_auto_on_a_gpu_machine_takes_the_gpu_and_native_bf16(monkeypatch):
    pretend_gpus(monkeypatch, 2, bf16=True)
    assert resolve_placement("auto", "auto") == (torch.device("cuda", 0), torch.bfloat16)
    assert resolve_placement("cuda:1", "float32") == (torch.device("cuda", 1), torch.float32)
    assert resolve_dtype("auto", torch.device("cpu")) is None
    pretend_gpus(monkeypatch, 1, bf16=False)  # pre-Ampere: bf16 only emulated, keep the saved dtype
    assert resolve_placement("auto", "auto") == (torch.device("cuda", 0), None)


def test_impossible_placements_are_refused_by_name(monkeypatch):
    pretend_gpus(monkeypatch, 1, bf16=True)
    with pytest.raises(ConfigError, match="1 visible GPU"):
        resolve_device("cuda:3")
    with pytest.raises(ConfigError, match="not a device"):
        resolve_device("gpu0")
    with pytest.raises(ConfigError, match="choose one of"):
        resolve_dtype("fp8", torch.device("cpu"))
    pretend_gpus(monkeypatch, 0, False)
    with pytest.raises(ConfigError, match="0 visible GPU"):
        resolve_device("cuda")


@pytest.mark.timeout(60)
def test_generate_takes_dtype_and_refuses_a_missing_gpu(tokenizer, tmp_path, capsys, monkeypatch):
    model_dir = tmp_path / "m"
    make_model("tiny", seed=5, vocab_size=tokenizer.vocab_size).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out.jsonl"
    loaded = []
    from astrai.inference.engine import InferenceEngine
    original = InferenceEngine.__init__

    def recording_init(self, model, *args, **kwargs):
        loaded.append({m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)})
        original(self, model, *args, **kwargs)

    monkeypatch.setattr(InferenceEngine, "__init__", recording_init)
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--dtype", "bfloat16", "--device", "cpu",
                 "--max-tokens", "3", "--temperature", "0", "--output", str(out)]) == 0
    assert loaded == [{torch.bfloat16}]  # on the CPU bf16 casts the linear weights (cast_linear_weights)
    assert json.loads(out.read_text().splitlines()[0])["completion_tokens"] <= 3
    pretend_gpus(monkeypatch, 0, False)
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--device", "cuda"]) == 2
    assert "visible GPU" in capsys.readouterr().err


def test_serve_passes_the_placement_to_the_engine(monkeypatch, tmp_path):
    from astrai.serving import launch

    seen = {}
    monkeypatch.setattr(launch, "run_server", lambda model_dir, **kwargs: seen.update(kwargs))
    pretend_gpus(monkeypatch, 1, bf16=True)
    assert main(["serve", "--model", str(tmp_path)]) == 0
    assert (seen["device"], seen["dtype"]) == (torch.device("cuda", 0), torch.bfloat16)
    assert main(["serve", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32"]) == 0
    assert (seen["device"], seen["dtype"]) == (torch.device("cpu"), torch.float32)
