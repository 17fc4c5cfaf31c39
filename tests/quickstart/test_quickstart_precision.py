"""Pre-training's and SFT's precision: probed against fp32 where bf16 matmuls are fast, kept
in the plan, and the fp32 stages (DPO, GRPO) sized by the fp32 rate."""

import json
from types import SimpleNamespace

import pytest

from astrai.backends import Backend, backend_for
from astrai.backends.cpu import training
from astrai.backends.cpu.training import cpu_bf16_matmul_pays
from astrai.cli import main
from astrai.errors import ConfigError
from astrai.quickstart.from_scratch import (BF16_MIN_GAIN, Deadline, Quickstart, Settings, load_plan, plan_of,
                                            write_json)


def planner(tmp_path, rates, bf16_pays=True, monkeypatch=None, **settings):
    """A run that has its data, whose probe reports ``rates`` per precision."""
    qs = Quickstart(Settings(out=str(tmp_path), **settings))
    qs.deadline = Deadline(15.0)
    qs.tokenizer = SimpleNamespace(vocab_size=4096)
    write_json(qs.done_path("data"), {kind: {"written": n, "tokens": 50 * n} for kind, n in
                                      (("pretrain", 2000), ("sft", 7000), ("dpo", 2800), ("grpo", 500))})
    probed = []

    def probe(precision):
        probed.append(precision)
        return rates[precision]

    monkeypatch.setattr(qs, "probe_throughput", probe)
    monkeypatch.setattr(Backend, "bf16_training_pays", lambda self: bf16_pays)
    return qs, probed


def test_bf16_trains_pretraining_and_sft_when_the_probe_finds_it_faster(tmp_path, monkeypatch):
    qs, probed = planner(tmp_path, {"auto": 4000.0, "bf16": 7000.0}, monkeypatch=monkeypatch)
    qs.tps = qs.measure_throughput()
    assert probed == ["auto", "bf16"] and qs.tps == 7000.0 and qs.precision == "bf16"
    saved = json.loads((tmp_path / "throughput.json").read_text())
    assert saved["precision"] == "bf16" and saved["speedup"] == pytest.approx(1.75)
    assert saved["probed"] == {"auto": 4000.0, "bf16": 7000.0}
    assert qs.train_config(0, "pretrain", 100.0).precision == "bf16"
    assert qs.train_config(1, "sft", 100.0).precision == "bf16"
    # DPO and GRPO stay at the trainer's default and are sized by the fp32 rate
    assert qs.train_config(2, "dpo", 100.0).precision == "auto"
    assert qs.train_config(3, "grpo", 100.0).precision == "auto"
    assert qs.fp32_tps == pytest.approx(4000.0)
    fp32_run, _ = planner(tmp_path / "fp32", {"auto": 4000.0}, bf16_pays=False, monkeypatch=monkeypatch)
    fp32_run.tps = fp32_run.measure_throughput()
    assert qs.dpo_plan(100.0)[0] == pytest.approx(fp32_run.dpo_plan(100.0)[0])
    assert qs.grpo_step_seconds() == pytest.approx(fp32_run.grpo_step_seconds())
    # a resumed run reads the decision back instead of probing again
    again = Quickstart(Settings(out=str(tmp_path)))
    assert again.measure_throughput() == 7000.0 and (again.precision, again.speedup) == ("bf16", pytest.approx(1.75))


def test_fp32_stays_when_bf16_is_not_clearly_faster(tmp_path, monkeypatch):
    qs, probed = planner(tmp_path, {"auto": 4000.0, "bf16": 4000.0 * BF16_MIN_GAIN * 0.99}, monkeypatch=monkeypatch)
    assert qs.measure_throughput() == 4000.0
    assert probed == ["auto", "bf16"] and qs.precision == "auto" and qs.speedup == 1.0
    assert qs.train_config(0, "pretrain", 100.0).precision == "auto"


@pytest.mark.parametrize("asked, bf16_pays, steps, expected_probes, chosen", [
    ("auto", False, None, ["auto"], "auto"),          # the device's bf16 matmuls are slow: no probe
    ("auto", True, {"pretrain": 5, "sft": 1, "dpo": 1, "grpo": 1}, ["auto"], "auto"),  # a pinned plan keeps its own
    ("fp32", True, None, ["fp32"], "fp32"),
    ("bf16", False, None, ["auto", "bf16"], "bf16"),  # asked for: taken even when slower
])
def test_which_precisions_are_probed(tmp_path, monkeypatch, asked, bf16_pays, steps, expected_probes, chosen):
    rates = {"auto": 4000.0, "fp32": 4000.0, "bf16": 3000.0}
    qs, probed = planner(tmp_path, rates, bf16_pays=bf16_pays, monkeypatch=monkeypatch, precision=asked, steps=steps)
    assert qs.measure_throughput() == rates[chosen]
    assert probed == expected_probes and qs.precision == chosen


def test_the_plan_keeps_the_precision_and_a_bad_one_is_refused(tmp_path):
    records = [{"name": n, "planned_steps": 4, "steps": 4, "precision": "bf16" if n in ("pretrain", "sft") else "auto"}
               for n in ("pretrain", "sft", "dpo", "grpo")]
    plan = plan_of(records, pinned=False)
    assert plan["precision"] == "bf16"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert load_plan(path)["precision"] == "bf16"
    path.write_text(json.dumps({"steps": plan["steps"]}))
    assert load_plan(path)["precision"] == "auto"
    path.write_text(json.dumps({**plan, "precision": "fp16"}))
    with pytest.raises(ConfigError, match="'precision' must be one of auto, fp32, bf16"):
        load_plan(path)


def test_cli_refuses_precision_with_base_or_against_the_plan(tmp_path, capsys):
    assert main(["quickstart", "--base", "smollm2", "--precision", "bf16", "--out", str(tmp_path / "b")]) != 0
    assert "--precision does not apply with --base" in capsys.readouterr().err
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"steps": {"pretrain": 5, "sft": 1, "dpo": 1, "grpo": 1}, "precision": "fp32"}))
    assert main(["quickstart", "--plan", str(plan), "--precision", "bf16", "--out", str(tmp_path / "q")]) != 0
    assert "--precision bf16 disagrees with the plan's 'fp32'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quickstart", "--precision", "fp16", "--out", str(tmp_path / "q")])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_the_cpu_backend_answers_whether_bf16_training_may_pay(monkeypatch):
    """The hook resolves to the CPU's measurement (AMX, or bf16 matmuls 1.25x faster than fp32's)."""
    assert backend_for("cpu").bf16_training_pays() is cpu_bf16_matmul_pays()
    assert Backend("meta").bf16_training_pays() is False
    for answer in (True, False):  # whatever this machine's CPU says, the backend passes it on
        monkeypatch.setattr(training, "cpu_bf16_matmul_pays", lambda: answer)
        assert backend_for("cpu").bf16_training_pays() is answer
