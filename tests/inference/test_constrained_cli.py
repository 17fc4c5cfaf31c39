"""``astrai generate --json-schema FILE``: every completion is JSON valid against the file's
schema, from a random-weight model that would not write JSON by itself; a JSONL line may
bring its own language instead."""

from __future__ import annotations

import io
import json

import jsonschema
import pytest

from astrai.cli import main
from inference_helpers import make_model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "rain": {"type": "boolean"}},
          "required": ["city", "rain"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("constrained_cli")
    make_model("tiny", vocab_size=tokenizer.vocab_size, max_len=256).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_json_schema_flag_holds_every_completion_to_the_file(model_dir, tmp_path, monkeypatch):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"prompt": "Weather?", "temperature": 1.0, "seed": 1}) + "\n"
                     + json.dumps({"prompt": "Code:", "regex": "[A-Z]{3}"}) + "\n")
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert main(["generate", "--model", str(model_dir), "--prompt", "Weather?", "--input", str(lines),
                 "--max-tokens", "80", "--json-schema", str(schema_file), "--json"]) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    for row in rows[:2]:
        assert row["finish_reason"] == "stop"
        jsonschema.validate(json.loads(row["text"]), SCHEMA)
    assert len(rows[2]["text"]) == 3 and rows[2]["text"].isupper()


def test_a_schema_file_that_is_not_json_is_a_clear_error(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--json-schema", str(bad)]) != 0
    err = capsys.readouterr().err
    assert "--json-schema" in err and "not valid JSON" in err and "Traceback" not in err
