"""Long commands say what they are doing while they do it, and end with a line saying what
they wrote where: on a non-terminal (as here, where stderr is captured) one line when a
phase starts and one when it ends, so logs stay readable."""

from __future__ import annotations

import json

import pytest

from astrai.cli import main


@pytest.mark.timeout(300)
def test_tokenizer_preprocess_and_train_report_progress_and_what_they_wrote(bundled_data, tmp_path, capsys):
    text = str(bundled_data / "pretrain" / "train.jsonl")
    tok, data, run = tmp_path / "tok", tmp_path / "data", tmp_path / "run"

    assert main(["tokenizer", "train", text, "--vocab_size", "400", "--out", str(tok)]) == 0
    out, err = capsys.readouterr()
    assert f"learn 400 tokens from {text} ..." in err and f"learn 400 tokens from {text}: done" in err
    assert out.splitlines()[-1].startswith(f"wrote {tok}: tokenizer.json and tokenizer_config.json, vocabulary 400")

    assert main(["preprocess", text, "-o", str(data), "--tokenizer", str(tok)]) == 0
    out, err = capsys.readouterr()
    phase = [line for line in err.splitlines() if line.startswith(f"tokenize {text}")]
    assert len(phase) == 2 and phase[0].endswith("MB) ...") and ": done (" in phase[1]
    tokens = json.loads(out[:out.rindex("}") + 1])["tokens"]
    assert out.splitlines()[-1].startswith(f"wrote {data}: {tokens:,} tokens of ")

    overrides = {"vocab_size": 400, "n_layers": 1, "dim": 32, "n_heads": 2, "n_kv_heads": 1, "dim_ffn": 64, "max_len": 64}
    assert main(["train", "--train_type", "seq", "--data_root_path", str(data), "--tokenizer_path", str(tok),
                 "--model_preset", "tiny", "--model_overrides", json.dumps(overrides), "--window_size", "32",
                 "--batch_per_device", "2", "--max_steps", "2", "--ckpt_dir", str(run)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"wrote {run / 'final'}: the trained model (checkpoints under {run})"
    assert (run / "final" / "config.json").is_file()
