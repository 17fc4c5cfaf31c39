"""`astrai serve` names the model after the run that made it, not after the directory the
trainer happened to call ``final``; ``--served-model-name`` overrides; /v1/models and the
start-up line say the name."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from astrai.cli import main
from astrai.config import preset
from astrai.inference import InferenceEngine
from astrai.serving import create_app, launch
from astrai.serving.cli import served_model_name
from astrai.model import AutoModel


@pytest.mark.parametrize("where,name", [("runs/demo/final", "demo"), ("runs/quickstart/model", "quickstart"),
                                        ("runs/sft/ckpt/checkpoint-200", "sft"), ("models/Qwen3-0.6B", "Qwen3-0.6B"),
                                        ("runs/qs/stages/grpo/ckpt/step_40", "grpo")])
def test_the_default_name_skips_the_names_a_run_gives_its_directories(tmp_path, where, name):
    (tmp_path / where).mkdir(parents=True)
    assert served_model_name(str(tmp_path / where)) == name


def test_a_gguf_file_is_named_without_its_suffix(tmp_path):
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    assert served_model_name(str(path)) == "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def final_dir(tokenizer, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=1, dim=32, n_heads=2,
                                         n_kv_heads=1, dim_ffn=64, max_len=128))
    path = tmp_path_factory.mktemp("serve_name") / "runs" / "poems-pt" / "final"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def listed_models(monkeypatch, argv: list[str]) -> list[str]:
    """The ids GET /v1/models lists for an `astrai serve` command line (served in-process)."""
    listed = []

    def serve(model_dir, model_name, **_):
        app = create_app(load_engine=lambda: InferenceEngine.from_pretrained(model_dir, max_batch_size=1, num_pages=16),
                         model_name=model_name)
        with TestClient(app, base_url="http://localhost") as client:
            listed.extend(m["id"] for m in client.get("/v1/models").json()["data"])

    monkeypatch.setattr(launch, "run_server", serve)
    assert main(["serve", *argv]) == 0
    return listed


@pytest.mark.timeout(60)
def test_v1_models_lists_the_default_name_and_the_override(final_dir, monkeypatch, capsys):
    assert listed_models(monkeypatch, ["--model", str(final_dir)]) == ["poems-pt"]
    assert "as model 'poems-pt'" in capsys.readouterr().err
    assert listed_models(monkeypatch, ["--model", str(final_dir), "--served-model-name", "tiny-poet"]) == ["tiny-poet"]
    assert "as model 'tiny-poet'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_uvicorn_app_takes_the_same_default_name(final_dir, monkeypatch):
    from astrai.inference import server

    monkeypatch.setenv("ASTRAI_MODEL", str(final_dir))
    monkeypatch.setenv("ASTRAI_DEVICE", "cpu")
    monkeypatch.setattr(server, "_app", None)
    with TestClient(server.app, base_url="http://localhost") as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["poems-pt"]
