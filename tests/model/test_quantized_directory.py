"""Quantized model directories: save/load round trip, ``astrai model quantize`` and its refusals."""

import json

import pytest
import torch
from safetensors import safe_open

from astrai.cli import main
from astrai.config import preset
from astrai.errors import AstraiError
from astrai.model import AutoModel
from astrai.model.quantized import QuantizedLinear, quantize_model


@pytest.fixture
def float_dir(tmp_path):
    src = tmp_path / "float"
    assert main(["model", "create", "--preset", "tiny", "--vocab_size", "96", "--out", str(src)]) == 0
    (src / "tokenizer_config.json").write_text("{}")
    return src


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-asym"])
def test_quantize_verb_writes_a_directory_the_loader_opens_as_it_is(fmt, float_dir, tmp_path, capsys):
    out = tmp_path / fmt
    plain = ["--calibration", "none"] if fmt == "int4" else []  # Q4_0's own rule: comparable below
    assert main(["model", "quantize", str(float_dir), "--to", fmt, "--out", str(out), *plain]) == 0
    assert f"{fmt} weights" in capsys.readouterr().out
    assert (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["quantization"] == {"format": fmt, "group_size": 32}
    assert main(["model", "info", str(out)]) == 0
    assert f"quantization: {{'format': '{fmt}'" in capsys.readouterr().out
    with safe_open(str(out / "model.safetensors"), framework="pt") as reader:
        keys = set(reader.keys())
        qdtype = reader.get_tensor("layers.0.mlp.down.qweight").dtype
    assert "layers.0.attention.q_proj.qweight" in keys and "layers.0.attention.q_proj.weight" not in keys
    assert qdtype == (torch.int8 if fmt == "int8" else torch.uint8)
    expected = quantize_model(AutoModel.from_pretrained(float_dir).eval(), fmt)
    loaded = AutoModel.from_pretrained(out).eval()
    assert isinstance(loaded.layers[1].mlp.down, QuantizedLinear) and loaded.lm_head.bits == 8
    assert loaded.layers[1].mlp.down.asymmetric == (fmt == "int4-asym")
    assert loaded.num_parameters() == AutoModel.from_pretrained(float_dir).num_parameters()
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids)["logits"], expected(ids)["logits"])
    bf16 = AutoModel.from_pretrained(out, dtype=torch.bfloat16)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16 and bf16.lm_head.scales.dtype == torch.float16


def test_quantize_verb_refuses_bad_input_in_one_line(float_dir, tmp_path, capsys):
    quantized = tmp_path / "q"
    assert main(["model", "quantize", str(float_dir), "--to", "int8", "--out", str(quantized)]) == 0
    capsys.readouterr()
    assert main(["model", "quantize", str(tmp_path), "--to", "int4", "--out", str(tmp_path / "x")]) == 2
    assert "config.json: missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["model", "quantize", str(float_dir), "--to", "int3", "--out", str(tmp_path / "y")])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    assert main(["model", "export", str(quantized), "--out", str(tmp_path / "hf")]) == 2
    assert "export the float model" in capsys.readouterr().err


def test_a_damaged_quantization_entry_or_tensor_is_named(float_dir, tmp_path):
    out = tmp_path / "q"
    quantize_model(AutoModel.from_pretrained(float_dir), "int4").save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization": {"format": "int2", "group_size": 32}}))
    with pytest.raises(AstraiError, match="quantization .* is not one astrai reads"):
        AutoModel.from_pretrained(out)
    (out / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    state["layers.0.mlp.up.scales"] = state["layers.0.mlp.up.scales"].float()
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(AstraiError, match="float16 'layers.0.mlp.up.scales'"):
        AutoModel.from_pretrained(out)


def test_int4_scales_are_calibrated_on_text_by_default(tokenizer, tokenizer_dir, tmp_path, bundled_data, capsys):
    """The default int4 quantization reads the bundled sample through the model and chooses each
    block's scale by its channels' importance: its output on other text is closer to the float
    model's than Q4_0's plain rule gives. The model's norms make a few channels loud, as a
    trained model's are (a random one's channels are all alike, leaving nothing to weigh)."""
    import shutil

    src = tmp_path / "float"
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size))
    loud = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.input_norm, layer.post_attention_norm):
                norm.weight.copy_(torch.exp(1.5 * torch.randn(norm.weight.shape, generator=loud)))
    model.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, src / name)
    calibrated, plain = tmp_path / "calibrated", tmp_path / "plain"
    assert main(["model", "quantize", str(src), "--to", "int4", "--out", str(calibrated)]) == 0
    assert "scales calibrated on train.jsonl" in capsys.readouterr().out
    assert json.loads((calibrated / "config.json").read_text())["quantization"]["calibrated"] is True
    assert main(["model", "quantize", str(src), "--to", "int4", "--out", str(plain), "--calibration", "none"]) == 0
    text = (bundled_data / "pretrain" / "valid_en.jsonl").read_text().splitlines()[0]
    ids = torch.tensor([tokenizer.encode(json.loads(text)["text"], add_special_tokens=False)[:64]])
    with torch.no_grad():
        reference = AutoModel.from_pretrained(src).eval()(ids)["logits"]
        errors = {name: (AutoModel.from_pretrained(d).eval()(ids)["logits"] - reference).pow(2).mean().item()
                  for name, d in (("calibrated", calibrated), ("plain", plain))}
    assert errors["calibrated"] < 0.9 * errors["plain"]
    assert main(["model", "quantize", str(src), "--to", "int8", "--out", str(tmp_path / "x"),
                 "--calibration", str(bundled_data / "pretrain" / "train.jsonl")]) == 2
    assert "--calibration applies to int4" in capsys.readouterr().err
    assert main(["model", "quantize", str(src), "--to", "int4", "--out", str(tmp_path / "y"),
                 "--calibration", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
