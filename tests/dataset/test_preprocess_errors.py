"""Bad input is reported with its file, line or key and the problem; --skip_bad counts instead."""

import json
import os

import pytest
from helpers_dataset import preprocess, write_jsonl

from astrai.cli import main
from astrai.dataset import DatasetFactory, create_storage
from astrai.errors import DataError

GOOD = {"text": "good line"}


@pytest.mark.parametrize("bad_line,train_type,message", [
    ('{"text": "cut off', "seq", r"bad\.jsonl:2: not valid JSON"),
    ('{"txt": "typo"}', "seq", r"bad\.jsonl:2: missing field 'text'"),
    ('{"text": 42}', "seq", r"bad\.jsonl:2: field 'text' must be a string, got int"),
    ('[1, 2]', "seq", r"bad\.jsonl:2: expected a JSON object, got list"),
    ('{"messages": [{"role": "user"}]}', "sft", r"bad\.jsonl:2: field 'messages': messages\[0\] is missing 'content'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "sft", r"bad\.jsonl:2: conversation has no assistant"),
    ('{"prompt": "p", "chosen": "a"}', "dpo", r"bad\.jsonl:2: missing field 'rejected'"),
    ('{"prompt": "p", "responses": ["a"], "rewards": ["high"]}', "grpo", r"bad\.jsonl:2: rewards\[0\] must be a finite"),
    ('{"prompt": "p", "responses": ["a", "b"], "rewards": [1.0]}', "grpo", r"bad\.jsonl:2: 'responses' \(2\) and 'rewards' \(1\)"),
])
def test_bad_lines_name_file_line_and_problem(tmp_path, tokenizer_dir, bad_line, train_type, message):
    good = {"seq": GOOD, "sft": {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "dpo": {"prompt": "p", "chosen": "a", "rejected": "b"},
            "grpo": {"prompt": "p", "responses": ["a"], "rewards": [1]}}[train_type]
    path = write_jsonl(tmp_path / "bad.jsonl", [good, bad_line, good])
    with pytest.raises(DataError, match=message):
        preprocess([path], tmp_path / "out", tokenizer_dir, train_type=train_type, seq_len=32)
    summary = preprocess([path], tmp_path / "out", tokenizer_dir, train_type=train_type, seq_len=32, skip_bad=True)
    assert summary["records"] == 3 and summary["written"] == 2 and sum(summary["skipped"].values()) == 1


def test_skip_bad_counts_each_reason(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, '{"text": ', '{"a": 1}', '{"text": null}', GOOD, "{"])
    summary = preprocess([path], tmp_path / "out", tokenizer_dir, skip_bad=True)
    assert summary["skipped"] == {"invalid JSON": 2, "missing field": 1, "wrong type": 1}
    assert summary["written"] == 2


def test_empty_and_missing_inputs(tmp_path, tokenizer_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: empty input"):
        preprocess([empty], tmp_path / "out", tokenizer_dir)
    with pytest.raises(DataError, match=r"nothere\.jsonl: input file not found"):
        preprocess([tmp_path / "nothere.jsonl"], tmp_path / "out", tokenizer_dir)
    with pytest.raises(DataError, match="--seq_len"):
        preprocess([empty], tmp_path / "out", tokenizer_dir, train_type="dpo")


def test_unreadable_storage_is_named(tmp_path, tokenizer_dir):
    with pytest.raises(DataError, match=r"nowhere: no such dataset"):
        DatasetFactory.load("seq", tmp_path / "nowhere", 8)
    (tmp_path / "blank").mkdir()
    with pytest.raises(DataError, match=r"blank: no dataset here"):
        DatasetFactory.load("seq", tmp_path / "blank", 8)
    path = write_jsonl(tmp_path / "ok.jsonl", [GOOD] * 20)
    preprocess([path], tmp_path / "ds", tokenizer_dir)
    shard = tmp_path / "ds" / "sequence.00000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"sequence\.00000\.bin: size .* truncated"):
        create_storage("mmap").load(tmp_path / "ds")
    shard.unlink()
    with pytest.raises(DataError, match=r"sequence\.00000\.bin: cannot be read"):
        DatasetFactory.load("seq", tmp_path / "ds", 8)
    (tmp_path / "ds" / "meta.json").write_text("{broken")
    with pytest.raises(DataError, match=r"meta\.json: cannot be read as JSON"):
        DatasetFactory.load("seq", tmp_path / "ds", 8)
    preprocess([path], tmp_path / "seq", tokenizer_dir)
    with pytest.raises(DataError, match=r"keys \['chosen'.*missing.*preprocessed as 'seq'"):
        DatasetFactory.load("dpo", tmp_path / "seq", 8)
    if os.geteuid() != 0:  # permissions do not bind root
        locked = tmp_path / "locked"
        preprocess([path], locked, tokenizer_dir)
        locked.chmod(0)
        try:
            with pytest.raises(DataError, match=r"locked: cannot be read \(permission denied\)"):
                DatasetFactory.load("seq", locked, 8)
        finally:
            locked.chmod(0o755)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x.json").write_text(json.dumps({"sequence": [[1, 2], [3]]}))
    with pytest.raises(DataError, match=r"x\.json: key 'sequence'"):
        DatasetFactory.load("seq", tmp_path / "foreign", 1)


def test_cli_reports_errors_without_traceback(tmp_path, tokenizer_dir, capsys):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, '{"text": 1}'])
    code = main(["preprocess", str(path), "-o", str(tmp_path / "out"), "--tokenizer", str(tokenizer_dir), "--quiet"])
    assert code == 2
    assert "bad.jsonl:2: field 'text' must be a string" in capsys.readouterr().err
    code = main(["preprocess", str(path), "-o", str(tmp_path / "out"), "--tokenizer", str(tokenizer_dir), "--quiet",
                 "--skip_bad", "--format", "h5"])
    assert code == 0 and '"wrong type": 1' in capsys.readouterr().out
