"""``astrai model export`` / ``astrai model import`` through the real command-line entry point."""

import torch
import transformers

from astrai.cli import main
from astrai.model import AutoModel


def test_export_then_import_round_trip_via_cli(tmp_path, capsys):
    src, hf_dir, back = tmp_path / "src", tmp_path / "hf", tmp_path / "back"
    assert main(["model", "create", "--preset", "tiny", "--vocab_size", "128", "--out", str(src)]) == 0
    (src / "tokenizer_config.json").write_text("{}")
    assert main(["model", "export", str(src), "--out", str(hf_dir), "--format", "llama"]) == 0
    assert (hf_dir / "tokenizer_config.json").is_file()
    reference = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    assert main(["model", "import", str(hf_dir), "--out", str(back)]) == 0
    original, restored = AutoModel.from_pretrained(src).eval(), AutoModel.from_pretrained(back).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(original(ids)["logits"], restored(ids)["logits"])
        torch.testing.assert_close(reference(ids).logits, original(ids)["logits"], rtol=0, atol=1e-4)


def test_export_to_a_family_that_does_not_fit_is_a_clean_error(tmp_path, capsys):
    src = tmp_path / "src"
    assert main(["model", "create", "--preset", "tiny", "--vocab_size", "128", "--out", str(src)]) == 0
    assert main(["model", "export", str(src), "--out", str(tmp_path / "x"), "--format", "qwen3"]) == 2
    assert "use_qk_norm=False does not fit qwen3; use format 'llama'" in capsys.readouterr().err
