"""Every train type resumes exactly through the CLI: a run cut after a save and resumed with
``--resume`` logs the same metrics, line for line, and ends on the same weights as a run never cut."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from astrai.alignment.kl import Stage
from astrai.alignment.kl_stages import RUN_CONFIG_NAME, stage_config_for
from astrai.cli import build_parser, main
from astrai.commands.train_run import build_config
from astrai.config import TrainConfig
from astrai.serialization import Checkpoint

from alignment_helpers import cli_train_args, run_metrics

STEPS, CUT = 6, 4
ONLINE_GRPO = ["--reward", "arithmetic", "--group_size", "2", "--max_new_tokens", "3", "--weight_sync_interval", "2",
               "--sync_interval", "3", "--temperature", "1.0"]
RUNS = {  # train type: (data, extra flags)
    "seq": ("seq", ["--window_size", "32"]),
    "sft": ("sft", []),
    "dpo": ("dpo", ["--beta", "0.5", "--max_lr", "1e-2"]),
    "rm": ("dpo", ["--max_lr", "1e-2"]),
    "grpo": ("grpo", ONLINE_GRPO + ["--max_lr", "1e-2"]),
}
TIMINGS = ("tokens_per_s", "rollout_s", "scoring_s", "rollout_tokens_per_s", "forward_s")


def comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


def args_for(prepared, tokenizer_dir, name, train_type, extra, steps=STEPS):
    data, flags = RUNS.get(train_type, ("seq", []))
    args = cli_train_args(prepared, tokenizer_dir, name, train_type, data) + flags + extra
    args[args.index("--max_steps") + 1] = str(steps)
    return args + ["--ckpt_interval", "2", "--ckpt_keep", "10", "--val_fraction", "0"]


def cut_after(run_dir, step):
    """What a run killed right after its save at ``step`` leaves behind (later saves and the final model gone;
    the metric log keeps its later lines, as a kill mid-step would: the resumed run drops them)."""
    for path in run_dir.iterdir():
        if path.name.startswith("step_") and int(path.name[5:]) > step or path.name == "final":
            shutil.rmtree(path)


def assert_same_run(straight, resumed):
    assert comparable(run_metrics(resumed)) == comparable(run_metrics(straight))
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("train_type", sorted(RUNS))
def test_resume_through_the_cli_is_exact(train_type, prepared, seq_data, sft_data, tokenizer_dir):
    straight, resumed = prepared / f"resume_{train_type}_a", prepared / f"resume_{train_type}_b"
    assert main(args_for(prepared, tokenizer_dir, straight.name, train_type, [])) == 0
    assert len(run_metrics(straight)) == STEPS
    shutil.copytree(straight, resumed)
    cut_after(resumed, CUT)
    assert main(args_for(prepared, tokenizer_dir, resumed.name, train_type, []) + ["--resume"]) == 0
    assert_same_run(straight, resumed)


def test_kl_run_resumes_inside_its_second_stage(prepared, seq_data, tokenizer_dir):
    """The reference of stage 1 comes back from the boundary checkpoint; stage 0 is not run again."""
    straight, resumed = prepared / "resume_kl_a", prepared / "resume_kl_b"
    stages = ["--stage_tokens", f"{3 * 4 * 32},{4 * 4 * 32}", "--beta", "1.0", "--window_size", "32"]
    args = args_for(prepared, tokenizer_dir, straight.name, "kl", stages)
    del args[args.index("--max_steps"):args.index("--max_steps") + 2]
    assert main(args) == 0
    shutil.copytree(straight, resumed)
    cut_after(resumed / "stage_1", 2)
    stage0 = (resumed / "stage_0" / "metrics.jsonl").stat().st_mtime_ns
    args[args.index("--ckpt_dir") + 1] = str(resumed)
    assert main(args + ["--resume"]) == 0
    assert (resumed / "stage_0" / "metrics.jsonl").stat().st_mtime_ns == stage0
    assert len(run_metrics(straight / "stage_1")) == 4
    assert_same_run(straight / "stage_1", resumed / "stage_1")
    boundaries = (resumed / "boundaries.jsonl").read_text().splitlines()
    assert [json.loads(line)["boundary"] for line in boundaries] == ["boundary_0_1"]


def test_a_kl_stage_checkpoint_alone_resumes_the_whole_run(tmp_path):
    """``astrai train --resume <run>/stage_1/step_N`` with no other flag gets the run's config back."""
    run = TrainConfig(train_type="kl", ckpt_dir=str(tmp_path), data_root_path="data", log_dir=str(tmp_path),
                      strategy_kwargs={"stages": [{"tokens": 64}, {"tokens": 64}]})
    run.save(tmp_path / RUN_CONFIG_NAME)
    stage = stage_config_for(run, Stage.parse([64, 64]), 1, beta=0.5)
    saved = tmp_path / "stage_1" / "step_00000002"
    Checkpoint({"w": torch.zeros(1)}, meta={"train_config": stage.to_dict()}).save(saved)
    config, resume = build_config(build_parser("train").parse_args(["train", "--resume", str(saved)]))
    assert (config.train_type, config.ckpt_dir, resume) == ("kl", str(tmp_path), str(saved))
