"""The quick start end to end at a miniature budget: every artefact, the numbers behind
the report's claims, and resuming an interrupted stage from its checkpoint.

The run uses fixed step counts (not the wall-clock sizing) so its numbers do not
depend on how busy the machine is; the sizing itself is tested in
test_quickstart_budget.py.
"""

import base64
import json
import re
import shutil
import time
from pathlib import Path

import pytest
from figures import same_figures

from astrai.quickstart.from_scratch import SFT_REPLAY, run_quickstart, sft_replay_for

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MINI = dict(
    minutes=5, seed=0, vocab_size=512, window_size=128, batch_size=8,
    model_overrides=dict(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, dim_ffn=192, max_len=256),
    steps={"pretrain": 300, "sft": 450, "dpo": 16, "grpo": 24},  # SFT: half of its batches replay pre-training text
    lr={"pretrain": 3e-3, "sft": 3e-3, "dpo": 5e-5, "grpo": 1e-5},
    sft_arithmetic=6000, eval_problems=100, ppl_max_tokens=3000, sample_max_new_tokens=12, progress=False,
    corpus="bundled",  # whether or not this machine has built the large corpus
    pretrain_arithmetic=0,  # the plain-text perplexities below are of the bundled text alone
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    summary = run_quickstart(out=str(out), **MINI)
    return out, summary


def stage(summary, name):
    return next(s for s in summary["stages"] if s["name"] == name)


def test_every_stage_trained_and_evaluated(run):
    out, summary = run
    assert [s["name"] for s in summary["stages"]] == ["pretrain", "sft", "dpo", "grpo"]
    for name, steps in MINI["steps"].items():
        record = stage(summary, name)
        assert record["steps"] == steps and record["tokens"] > 0
        assert (out / "stages" / name / "done.json").is_file()
        assert (out / "stages" / name / "ckpt" / "metrics.jsonl").is_file()
        assert set(record["eval"]["perplexity"]) == {"en", "zh"}  # after every stage
    assert summary["measured_tokens_per_s"] > 0
    # every GRPO prompt whole in its rows: rollouts see the question the evaluation asks
    grpo_data = json.loads((out / "stages" / "data" / "done.json").read_text())["grpo"]
    assert grpo_data["prompts"] > 0 and "prompts_truncated" not in grpo_data


def test_pretraining_beats_the_unigram_baseline(run):
    _, summary = run
    ppl = stage(summary, "pretrain")["eval"]["perplexity"]
    for language in ("en", "zh"):
        model, unigram = ppl[language]["perplexity"], ppl[language]["unigram_perplexity"]
        print(f"{language}: perplexity {model:.1f} vs unigram {unigram:.1f}")
        assert model < unigram


def test_sft_replay_keeps_the_plain_text_perplexity(run):
    """At least half of the SFT batches replay pre-training text. Without it this run's SFT took
    held-out perplexity from 43 / 35 (en / zh) to 116 / 71 (at 300 SFT steps), the full
    quick start's from 32 / 72 to about 180 / 450."""
    out, summary = run
    config = json.loads((out / "stages" / "sft" / "train_config.json").read_text())
    conversations = json.loads((out / "stages" / "data" / "done.json").read_text())["sft"]["tokens"]
    replay = sft_replay_for(conversations, config["max_steps"] * config["batch_per_device"] * config["window_size"])
    assert replay >= SFT_REPLAY
    assert [(Path(d["path"]).name, d["rate"], d.get("type")) for d in config["datasets"]] == \
        [("sft", 1 - replay, None), ("pretrain", replay, "seq")]
    before, after = (stage(summary, name)["eval"]["perplexity"] for name in ("pretrain", "sft"))
    for language in ("en", "zh"):
        print(f"{language}: perplexity {before[language]['perplexity']:.1f} -> {after[language]['perplexity']:.1f}")
        assert after[language]["perplexity"] < 1.2 * before[language]["perplexity"]


def test_sft_teaches_the_answer_format_and_later_stages_keep_it(run):
    """The task is measured on held-out two-digit problems no stage trains on; a model this
    small, trained this briefly, learns the format (a bare integer) long before the sums,
    so the test asks for the format: the mean reward credits a wrong integer with
    FORMAT_CREDIT, which tells how many answers were integers."""
    from astrai.eval.task_accuracy import FORMAT_CREDIT

    _, summary = run
    answered = {}
    for record in summary["stages"]:
        task = record["eval"]["task"]
        assert task["n"] == MINI["eval_problems"] and task["interval"][0] <= task["accuracy"] <= task["interval"][1]
        answered[record["name"]] = task["accuracy"] + (task["mean_reward"] - task["accuracy"]) / FORMAT_CREDIT
    print("share of held-out answers that are an integer, by stage:", answered)
    assert answered["sft"] >= 0.8 and answered["grpo"] >= 0.8


def test_model_directory_opens_in_automodel_and_the_server(run):
    from fastapi.testclient import TestClient

    from astrai.inference import InferenceEngine
    from astrai.serving.application import create_app
    from astrai.model import AutoModel
    from astrai.tokenize import AutoTokenizer

    out, summary = run
    model_dir = out / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    model = AutoModel.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.vocab_size == tokenizer.vocab_size == summary["model"]["vocab_size"]
    assert model.num_parameters() == summary["model"]["parameters"]

    app = create_app(load_engine=lambda: InferenceEngine.from_pretrained(str(model_dir)), model_name="quickstart")
    with TestClient(app, base_url="http://localhost") as client:  # a loopback Host, as a local client sends
        for _ in range(200):  # the engine loads in a background thread, as under `astrai serve`
            if client.get("/health/ready").status_code == 200:
                break
            time.sleep(0.05)
        assert client.get("/health").json()["ready"] is True
        reply = client.post("/v1/chat/completions", json={
            "model": "quickstart", "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 4,
            "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert isinstance(reply.json()["choices"][0]["message"]["content"], str)
    assert f"astrai serve --model {model_dir.resolve()}" in summary["commands"]["serve"]
    assert f"astrai chat --model {model_dir.resolve()}" in summary["commands"]["chat"]


def test_chat_command_opens_the_model_directory(run, monkeypatch, capsys):
    import io

    from astrai.cli import main

    out, _ = run
    monkeypatch.setattr("sys.stdin", io.StringIO("3+4=\n/exit\n"))
    assert main(["chat", "--model", str(out / "model"), "--max-tokens", "4", "--temperature", "0"]) == 0
    assert "assistant>" in capsys.readouterr().out


def test_the_reports_eval_command_prints_the_reports_figures(run, capsys):
    """The command the report prints, with no flags: the final model's eval_config.json
    makes astrai eval score and ask as the report's last row did."""
    import shlex

    from astrai.cli import main

    _, summary = run
    command = shlex.split(summary["commands"]["eval"])
    assert command[1:] == ["eval", "--model", str(Path(summary["model_dir"]).resolve())]
    capsys.readouterr()
    assert main(command[1:]) == 0
    results = json.loads(capsys.readouterr().out)
    grpo = stage(summary, "grpo")["eval"]
    assert same_figures(results["perplexity"], grpo["perplexity"]) and results["task"] == grpo["task"]
    assert results["samples"] == grpo["samples"]


def test_report_has_the_numbers_and_valid_plots(run):
    import matplotlib.image

    out, summary = run
    md = (out / "report.md").read_text(encoding="utf-8")
    html = (out / "report.html").read_text(encoding="utf-8")
    pretrain_en = stage(summary, "pretrain")["eval"]["perplexity"]["en"]["perplexity"]
    grpo_accuracy = stage(summary, "grpo")["eval"]["task"]["accuracy"]
    for text in (md, html):
        assert f"{pretrain_en:.2f}" in text and f"{grpo_accuracy:.3f}" in text
        assert summary["commands"]["serve"] in text and summary["commands"]["chat"] in text
        assert f"quickstart --minutes 20 --out {out}-longer" in summary["commands"]["longer"]
        assert summary["commands"]["longer"] in text and summary["headline"].split(":")[0].replace("`", "") in \
            text.replace("`", "")
        assert "中国的首都是哪里？" in text  # the Chinese sample prompt
    plots = sorted((out / "plots").glob("*.png"))
    assert [p.stem for p in plots] == ["accuracy", "dpo", "grpo", "pretrain", "sft"]
    for plot in plots:
        assert plot.read_bytes()[:8] == PNG_SIGNATURE
        assert matplotlib.image.imread(plot).ndim == 3
        assert f"](plots/{plot.name})" in md
    inlined = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(inlined) == 5 and "<img" in html and 'src="plots/' not in html
    assert all(base64.b64decode(b)[:8] == PNG_SIGNATURE for b in inlined)


def test_rerun_skips_finished_stages_and_resumes_an_unfinished_one(run, tmp_path):
    out, summary = run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    grpo = copy / "stages" / "grpo"
    checkpoints = sorted((grpo / "ckpt").glob("step_*"))
    assert len(checkpoints) >= 2
    # as if killed after the first kept checkpoint: later checkpoints, the result and the marker never written
    for later in checkpoints[1:]:
        shutil.rmtree(later)
    shutil.rmtree(grpo / "ckpt" / "final")
    (grpo / "done.json").unlink()
    resumed_from = int(checkpoints[0].name.split("_")[1])
    again = run_quickstart(out=str(copy), progress=False)  # the rest comes from the run's settings.json
    for name in ("pretrain", "sft", "dpo"):  # untouched: read back from their markers
        assert stage(again, name) == stage(summary, name)
    record = stage(again, "grpo")
    assert record["steps"] == MINI["steps"]["grpo"] and resumed_from < record["steps"]
    steps_logged = [r["step"] for r in map(json.loads, (grpo / "ckpt" / "metrics.jsonl").read_text().splitlines())]
    assert steps_logged == list(range(1, MINI["steps"]["grpo"] + 1))
    assert (copy / "model" / "model.safetensors").is_file()


def test_report_headline_and_changes_come_from_the_runs_own_figures(run):
    """Each stage is set against the stage before it (not the first), from the evaluations
    in summary.json, and the report leads with a headline written from those figures."""
    out, summary = run
    names = [s["name"] for s in summary["stages"]]
    assert [(c["against"], c["stage"]) for c in summary["changes"]] == list(zip(names, names[1:]))
    for change in summary["changes"]:
        before, after = stage(summary, change["against"])["eval"], stage(summary, change["stage"])["eval"]
        points = 100 * (after["task"]["accuracy"] - before["task"]["accuracy"])
        assert change["accuracy"]["points"] == pytest.approx(points)
        low, high = change["accuracy"]["interval"]
        assert low <= points <= high and high - low > 0
        for language in ("en", "zh"):
            bpb = after["perplexity"][language]["bits_per_byte"] / before["perplexity"][language]["bits_per_byte"] - 1
            assert change["bits_per_byte"][language]["relative"] == pytest.approx(bpb)
    grpo = summary["changes"][-1]
    md = (out / "report.md").read_text(encoding="utf-8")
    html = (out / "report.html").read_text(encoding="utf-8")
    assert md.splitlines()[2] == summary["headline"]  # right under the title
    pretrain_en = stage(summary, "pretrain")["eval"]["perplexity"]["en"]
    assert f"en {pretrain_en['bits_per_byte']:.3f} (unigram baseline" in summary["headline"]
    assert f"GRPO against DPO: bits/byte en {grpo['bits_per_byte']['en']['relative']:+.1%}" in summary["headline"]
    assert f"({grpo['accuracy']['points']:+.1f} points" in summary["headline"]
    row = "| GRPO | DPO | " + "{:.3f} → {:.3f} ({:+.1%})".format(*(grpo["bits_per_byte"]["en"][k] for k in
                                                                       ("before", "after", "relative")))
    assert row in md and "What each stage changed" in html
    assert "{:+.1f} [{:+.1f}, {:+.1f}]".format(grpo["accuracy"]["points"], *grpo["accuracy"]["interval"]) in md
