"""The GGUF → directory → quantize journey: requantizing imported blocks, sizes on disk against
the GGUF of the same types, logical parameter counts, progress, and calibration of short models."""

import io
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_import import SHAPE, build_case, vocab, write_gguf  # noqa: F401 (vocab is a fixture)

from astrai.cli import main
from astrai.config import preset
from astrai.model import AutoModel
from astrai.model.weight_files import weight_bytes
from astrai.model.calibration import calibrate
from astrai.model.quantized import QuantizedLinear, quantize_model, quantize_weight
from astrai.progress import Phase

FORMAT_OF = {Q.Q8_0: "int8", Q.Q4_0: "int4", Q.Q4_1: "int4-asym"}
WIDE = {**SHAPE, "hidden_size": 256, "intermediate_size": 512}  # weights outweigh the files' headers


def typed_gguf(path, reference, float_tensors, linear_type: Q, vocab):
    """A GGUF of ``reference`` whose linears are ``linear_type`` and whose tied table is Q8_0
    (as astrai keeps a head at int8); norms and biases F32."""
    tensors, kinds = {}, {}
    for name, weight in float_tensors.items():
        kind = (Q.Q8_0 if name == "model.embed_tokens.weight" else linear_type) if weight.ndim == 2 else Q.F32
        tensors[name] = gguf.quants.quantize(weight, kind) if kind != Q.F32 else weight
        kinds[name] = kind
    return write_gguf(path, reference, tensors, linear_type, vocab, kinds=kinds)


def tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("target", ["int8", "int4", "int4-asym"])
def test_an_imported_mixed_gguf_directory_quantizes_again_from_its_blocks(target, vocab, tmp_path, capsys):
    reference, tensors = build_case("qwen2", Q.F32, vocab)  # tied, like SmolLM2
    path = typed_gguf(tmp_path / "m.gguf", reference, tensors, Q.Q4_1, vocab)  # Q4_1 linears, Q8_0 table: "mixed"
    imported = tmp_path / "imported"
    assert main(["model", "import", str(path), "--out", str(imported)]) == 0
    assert json.loads((imported / "config.json").read_text())["quantization"]["format"] == "mixed"
    captured = capsys.readouterr()
    n_tensors = len(gguf.GGUFReader(str(path)).tensors)
    assert any(line.startswith(f"read {path}: done ({n_tensors} tensor, ") for line in captured.err.splitlines())
    assert captured.out.splitlines()[-1].startswith(f"wrote {imported}: ")
    out = tmp_path / target
    assert main(["model", "quantize", str(imported), "--to", target, "--out", str(out), "--calibration", "none"]) == 0
    assert "requantized from its mixed blocks" in capsys.readouterr().out
    model = AutoModel.from_pretrained(out)
    float_model = AutoModel.from_pretrained(path)  # the GGUF dequantized: what the blocks stand for
    expected = quantize_model(AutoModel.from_pretrained(path), target)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            other = expected.get_submodule(name)
            assert torch.equal(module.qweight, other.qweight) and torch.equal(module.scales, other.scales), name
    assert model.config.tie_weight and model.num_parameters() == float_model.num_parameters()
    q, d = quantize_weight(float_model.embed_tokens.weight, 8)  # the table: the GGUF's Q8_0 blocks, rounded again
    assert torch.equal(model.lm_head.qweight, q) and torch.equal(model.lm_head.scales, d)


@pytest.mark.parametrize("linear_type", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_a_quantized_directory_is_no_larger_than_the_gguf_of_the_same_types(linear_type, vocab, tmp_path):
    """The float GGUF imported and quantized here against llama.cpp's layout of the same types: the
    linears in the format, the tied table Q8_0 (astrai's int8 head), norms and biases F32."""
    reference, tensors = build_case("qwen2", Q.F32, vocab, shape=WIDE)
    float_gguf = write_gguf(tmp_path / "f32.gguf", reference, tensors, Q.F32, vocab)
    typed = typed_gguf(tmp_path / "typed.gguf", reference, tensors, linear_type, vocab)
    out = tmp_path / "q"
    fmt = FORMAT_OF[linear_type]
    assert main(["model", "quantize", str(float_gguf), "--to", fmt, "--out", str(out), "--calibration", "none"]) == 0
    on_disk = (out / "model.safetensors").stat().st_size
    assert on_disk == weight_bytes(out)
    assert on_disk <= 1.05 * tensor_bytes(typed), (on_disk, tensor_bytes(typed))
    assert on_disk <= typed.stat().st_size  # the GGUF's metadata (its tokenizer) on top


@pytest.mark.parametrize("tie", [True, False])
def test_logical_parameter_counts_are_the_same_at_every_precision(tie, tmp_path, capsys):
    src = tmp_path / "float"
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny", vocab_size=96, n_layers=2, tie_weight=tie))
    model.save_pretrained(src)
    (src / "tokenizer_config.json").write_text("{}")
    AutoModel.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    counts = {"fp32": model.num_parameters()}
    for fmt in ("int8", "int4", "int4-asym"):
        assert main(["model", "quantize", str(src), "--to", fmt, "--out", str(tmp_path / fmt),
                     "--calibration", "none"]) == 0
    capsys.readouterr()
    for name in ("bf16", "int8", "int4", "int4-asym"):
        assert main(["model", "info", str(tmp_path / name)]) == 0
        lines = dict(line.strip().split(": ", 1) for line in capsys.readouterr().out.splitlines())
        counts[name] = int(lines["parameters"].replace(",", ""))
        assert int(lines["weights on disk"].split()[0].replace(",", "")) == weight_bytes(tmp_path / name)
    assert set(counts.values()) == {model.num_parameters()}, counts


def test_a_directory_of_the_older_layout_still_opens(tmp_path):
    """Before a tied head kept its tie, a quantized tied model was saved untied: the float table
    and an int8 copy of it as the head. Such a directory opens as it was written."""
    torch.manual_seed(0)
    model = quantize_model(AutoModel.from_config(preset("tiny", vocab_size=96, n_layers=2)).eval(), "int4")
    model.config.tie_weight = False
    model.save_pretrained(tmp_path / "old")
    loaded = AutoModel.from_pretrained(tmp_path / "old").eval()
    assert not loaded.config.tie_weight and isinstance(loaded.lm_head, QuantizedLinear)
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids)["logits"], model(ids)["logits"])


def test_quantize_reports_each_phase_and_where_it_wrote(tokenizer_dir, tmp_path, capsys):
    src = tmp_path / "float"
    AutoModel.from_config(preset("tiny", vocab_size=1000, n_layers=2)).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, src / name)
    out = tmp_path / "q4"
    assert main(["model", "quantize", str(src), "--to", "int4", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    for phase in (f"read {src}", "calibrate on train.jsonl", "quantize to int4", f"write {out}"):
        assert any(line.startswith(phase) and line.endswith("...") for line in err), (phase, err)
        assert any(line.startswith(f"{phase}: done") for line in err), (phase, err)
    assert "quantize to int4 (15 linear) ..." in err  # 2 layers x 7 projections and the head
    last = captured.out.splitlines()[-1]
    assert last.startswith(f"wrote {out}: ") and "MB of weights" in last


def test_a_phase_is_a_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    with Phase("quantize to int8", total=4, unit="linear", stream=stream) as step:
        for _ in range(4):
            step(1)
    assert "quantize to int8" in stream.getvalue() and "4/4" in stream.getvalue() and "..." not in stream.getvalue()


def test_calibration_fits_a_model_shorter_than_its_window(tokenizer, tokenizer_dir, bundled_data, tmp_path):
    model = AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=2, max_len=128)).eval()
    importance = calibrate(model, tokenizer, bundled_data / "pretrain" / "train.jsonl", tokens=600)
    assert set(importance) == {f"layers.{i}.{p}" for i in range(2) for p in (
        "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "mlp.gate", "mlp.up",
        "mlp.down")}
    assert all(torch.isfinite(v).all() and (v > 0).any() for v in importance.values())
    src = tmp_path / "short"
    model.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, src / name)
    assert main(["model", "quantize", str(src), "--to", "int4", "--out", str(tmp_path / "q")]) == 0
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]["calibrated"] is True
    assert np.isfinite(AutoModel.from_pretrained(tmp_path / "q").lm_head.scales.float().numpy()).all()
