"""The quick start's report and ``astrai eval`` score held-out text through one code path:
the command the report prints gives the report's figures on the same model."""

import json
import shlex

from astrai.cli import main
from astrai.config import preset
from astrai.model import AutoModel
from astrai.quickstart import Quickstart, Settings


def test_the_reports_eval_command_gives_the_reports_perplexity(tokenizer, tmp_path, capsys):
    run = Quickstart(Settings(out=str(tmp_path / "run"), eval_problems=2, sample_max_new_tokens=2, ppl_max_tokens=400))
    run.tokenizer = tokenizer
    model_dir = run.model_dir("sft")
    AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=2)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    report = run.evaluate("sft")["perplexity"]
    command = shlex.split(run.eval_command("astrai", str(model_dir)))
    assert command[:2] == ["astrai", "eval"]
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main([*command[1:], "--task-problems", "0", "--no-samples", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["perplexity"] == report == json.loads(out.read_text())["perplexity"]
    assert set(report) == {"en", "zh"} and all(r["tokens"] >= 400 for r in report.values())
    err = captured.err.splitlines()
    assert "perplexity en ..." in err and any(line.startswith("perplexity zh: done") for line in err)
    assert err[-1] == f"wrote {out}: the results above as JSON"
