"""The quick start's report and ``astrai eval`` score a model through one code path, and the
settings the report used travel with the model (eval_config.json): plain
``astrai eval --model DIR`` gives the report's figures."""

import json

import pytest
from figures import same_figures

from astrai.cli import main
from astrai.config import preset
from astrai.errors import ConfigError
from astrai.eval.recorded import EVAL_CONFIG, load_eval_config
from astrai.model import AutoModel
from astrai.quickstart.from_scratch import Quickstart, Settings


def test_plain_astrai_eval_gives_the_reports_figures(tokenizer, tmp_path, capsys):
    # a window shorter than the model's max_len, a token limit, a task pool's first few problems,
    # and task answers shorter than the samples': each differs from astrai eval's own default
    run = Quickstart(Settings(out=str(tmp_path / "run"), window_size=64, ppl_max_tokens=400, eval_problems=6,
                              eval_max_new_tokens=3, sample_max_new_tokens=5))
    run.tokenizer = tokenizer
    model_dir = run.model_dir("sft")
    AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=2)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    report = run.evaluate("sft")
    assert load_eval_config(model_dir) == {"ppl_window": 64, "ppl_max_tokens": 400, "task_problems": 6,
                                           "task_max_new_tokens": 3, "max_new_tokens": 5}
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(model_dir), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    results = json.loads(captured.out)
    assert results == json.loads(out.read_text())
    for section in ("perplexity", "task", "samples"):
        assert same_figures(results[section], report[section]), section
    assert set(report["perplexity"]) == {"en", "zh"} and all(r["tokens"] >= 400 for r in report["perplexity"].values())
    assert report["task"]["n"] == 6
    err = captured.err.splitlines()
    assert f"{model_dir / EVAL_CONFIG}: ppl_window=64, ppl_max_tokens=400, task_problems=6, task_max_new_tokens=3, " \
           f"max_new_tokens=5 (the settings the model was evaluated with; a flag overrides each)" in err
    assert "perplexity en ..." in err and any(line.startswith("perplexity zh: done") for line in err)
    assert err[-1] == f"wrote {out}: the results above as JSON"


def test_a_flag_overrides_the_recorded_setting(tokenizer, tmp_path, capsys):
    model_dir = tmp_path / "model"
    AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=1)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (model_dir / EVAL_CONFIG).write_text(json.dumps({"ppl_max_tokens": 200, "task_problems": 4}))
    assert main(["eval", "--model", str(model_dir), "--task-problems", "2", "--no-samples", "--no-perplexity"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["task"]["n"] == 2
    assert f"{model_dir / EVAL_CONFIG}: ppl_max_tokens=200 (the settings" in captured.err


@pytest.mark.parametrize("content, message", [
    ("{", "not JSON"),
    ('{"ppl_window": 0}', "ppl_window must be null or an integer >= 1, got 0"),
    ('{"window": 256}', "unknown evaluation setting(s) window"),
    ("[256]", "expected a JSON object of evaluation settings, got list"),
])
def test_a_broken_eval_config_is_a_clear_error(tmp_path, content, message):
    (tmp_path / EVAL_CONFIG).write_text(content)
    with pytest.raises(ConfigError, match=f"{EVAL_CONFIG}: .*{message}".replace("(", r"\(").replace(")", r"\)")):
        load_eval_config(tmp_path)
