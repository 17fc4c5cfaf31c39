"""``astrai train --train_type dpo|rm|grpo`` end to end on bundled data (tiny model, a few steps)."""

import json

import torch

from astrai.cli import main
from astrai.model import AutoModel
from astrai.model.reward import RewardModel

from alignment_helpers import cli_train_args as common, run_metrics as metrics


def test_cli_lora_dpo_saves_adapters_and_merged_model(prepared, tokenizer_dir):
    args = common(prepared, tokenizer_dir, "dpo_lora", "dpo", "dpo") + [
        "--beta", "0.2", "--lora_rank", "4", "--lora_targets", "q_proj,v_proj"]
    assert main(args) == 0
    run = prepared / "dpo_lora"
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["rank"] == 4 and config["alpha"] == 8.0 and config["targets"] == ["q_proj", "v_proj"]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModel.from_pretrained(run / "final")
    assert merged(torch.tensor([[1, 2, 3]]))["logits"].shape == (1, 3, 1000)
    logged = metrics(run)
    assert "reward_accuracy" in logged[-1] and "reward_margin" in logged[-1] and "chosen_nll" not in logged[-1]


def test_cli_dpo_takes_rpo_alpha(prepared, tokenizer_dir, capsys):
    assert main(common(prepared, tokenizer_dir, "dpo_rpo", "dpo", "dpo") + ["--rpo_alpha", "0.5"]) == 0
    assert "chosen_nll" in metrics(prepared / "dpo_rpo")[-1]
    assert main(common(prepared, tokenizer_dir, "dpo_bad", "dpo", "dpo") + ["--rpo_alpha", "-1"]) == 2
    assert "rpo_alpha must be >= 0" in capsys.readouterr().err


def test_cli_reward_model_and_grpo(prepared, tokenizer_dir):
    assert main(common(prepared, tokenizer_dir, "rm", "rm", "dpo")) == 0
    assert isinstance(AutoModel.from_pretrained(prepared / "rm" / "final"), RewardModel)
    assert "reward_accuracy" in metrics(prepared / "rm")[-1]
    args = common(prepared, tokenizer_dir, "grpo", "grpo", "grpo") + [
        "--reward", "arithmetic", "--group_size", "2", "--max_new_tokens", "3", "--kl_coef", "0.02"]
    assert main(args) == 0
    logged = metrics(prepared / "grpo")
    assert {"reward_mean", "reward_std", "kl", "clip_fraction", "response_length"} <= set(logged[-1])
    saved = json.loads((prepared / "grpo" / "final" / "config.json").read_text())
    assert saved["model_type"] == "transformer"


def test_trainer_refreshes_the_rollout_policy_after_every_optimizer_step(prepared, tokenizer_dir, monkeypatch):
    """Online GRPO must sample from the updated policy: the Trainer fires the strategy's own
    callback, which runs ``after_optimizer_step`` (engine weights, behaviour copy) once per step."""
    from astrai.alignment.grpo import GRPOStrategy

    seen = []
    original = GRPOStrategy.after_optimizer_step

    def counting(self):
        seen.append(self.steps)
        original(self)

    monkeypatch.setattr(GRPOStrategy, "after_optimizer_step", counting)
    args = common(prepared, tokenizer_dir, "grpo_sync", "grpo", "grpo") + [
        "--reward", "arithmetic", "--group_size", "2", "--max_new_tokens", "2"]
    assert main(args) == 0
    assert seen == [0, 1]


def test_cli_rejects_bad_alignment_flags(prepared, tokenizer_dir, capsys):
    assert main(common(prepared, tokenizer_dir, "bad", "grpo", "grpo") + ["--group_size", "1", "--reward", "arithmetic"]) == 2
    assert "group_size must be an integer >= 2" in capsys.readouterr().err
    assert main(common(prepared, tokenizer_dir, "bad2", "kl", "dpo")) == 2
    assert "needs stages" in capsys.readouterr().err


def test_cli_kl_stages(prepared, seq_data, tokenizer_dir):
    args = common(prepared, tokenizer_dir, "kl", "kl", "seq")
    args[args.index("--window_size") + 1] = "32"
    args[args.index("--max_steps"):args.index("--max_steps") + 2] = []
    assert main(args + ["--stage_tokens", "256,256", "--beta", "0.2"]) == 0
    run = prepared / "kl"
    assert (run / "boundary_0_1" / "meta.json").is_file()
    assert (run / "stage_1" / "final" / "model.safetensors").is_file()
    stage0, stage1 = metrics(run / "stage_0"), metrics(run / "stage_1")
    assert {r["beta"] for r in stage0} == {0.0} and {r["beta"] for r in stage1} == {0.2}
    assert {r["stage"] for r in stage1} == {1.0}


def test_cli_kl_checks_every_stage_before_training(prepared, seq_data, tokenizer_dir, capsys):
    """Bad data in a later stage is reported before stage 0 spends any time training."""
    args = common(prepared, tokenizer_dir, "kl_bad", "kl", "seq")
    args[args.index("--window_size") + 1] = "32"
    args[args.index("--max_steps"):args.index("--max_steps") + 2] = []
    for late, expected in [(prepared / "no_such_data", "does not exist"), (prepared / "grpo", "seq data needs keys")]:
        mixtures = [[{"path": str(seq_data)}], [{"path": str(late), "rate": 1.0}]]
        assert main(args + ["--stage_tokens", "256,256", "--stage_datasets", json.dumps(mixtures)]) == 2
        err = capsys.readouterr().err
        assert "KL stage 1" in err and late.name in err and expected in err, err
        assert not (prepared / "kl_bad" / "stage_0").exists()  # nothing trained


def test_preference_record_without_rejected_is_named(tmp_path, tokenizer_dir, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "hi", "chosen": "a", "rejected": "b"}\n{"prompt": "x", "chosen": "y"}\n')
    assert main(["preprocess", str(pairs), "-o", str(tmp_path / "out"), "--tokenizer", str(tokenizer_dir),
                 "--train_type", "dpo", "--seq_len", "32", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "rejected" in err and ":2" in err, err


def test_train_command_sends_only_alignment_runs_to_alignment(prepared, seq_data, tokenizer_dir, monkeypatch):
    """Plain pre-training runs a Trainer directly; a reward model (or LoRA, or KL stages) goes
    through ``astrai.alignment.train``."""
    import astrai.commands.train_run as train_run

    sent = []
    original = train_run.train
    monkeypatch.setattr(train_run, "train", lambda config, resume=None: sent.append(config.train_type) or
                        original(config, resume))
    assert main(common(prepared, tokenizer_dir, "plain", "seq", "seq")) == 0
    assert sent == []
    assert main(common(prepared, tokenizer_dir, "rm_choice", "rm", "dpo")) == 0
    assert sent == ["rm"]
