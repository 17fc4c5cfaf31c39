"""TrainConfig round trip and validation; bad configurations fail before training starts."""

import json

import pytest
from trainer_helpers import TokenWindows, config, tiny_model

from astrai.commands.train import add_arguments
from astrai.commands.train_run import build_config
from astrai.config import TrainConfig
from astrai.errors import ConfigError
from astrai.trainer import Trainer


def test_json_round_trip(tmp_path):
    cfg = TrainConfig(train_type="sft", max_lr=1e-3, datasets=[{"path": "a", "rate": 0.5}], strategy_kwargs={"beta": 0.2})
    path = tmp_path / "train.json"
    cfg.save(path)
    assert TrainConfig.load(path) == cfg
    with pytest.raises(ConfigError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"max_lr": 1e-3, "bogus": 1})


@pytest.mark.parametrize("field,value", [("max_lr", -1e-3), ("batch_per_device", 0), ("warmup_ratio", 1.5),
                                         ("train_type", "pretrain"), ("schedule", "linear")])
def test_validate_names_the_bad_field(tmp_path, field, value):
    cfg = TrainConfig(data_root_path=str(tmp_path), model_preset="tiny", **{field: value})
    with pytest.raises(ConfigError, match=field):
        cfg.validate()


def test_missing_data_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="data_root_path"):
        TrainConfig(data_root_path=str(tmp_path / "nope"), model_preset="tiny").validate()
    with pytest.raises(ConfigError, match="data_root_path"):
        TrainConfig(model_preset="tiny").validate()


class NeverStep:
    def on_batch_begin(self, context):
        raise AssertionError("training started despite a bad config")


def _fails_before_training(tmp_path, match, **kwargs):
    cfg = config(tmp_path, **kwargs.pop("cfg", {}))
    with pytest.raises(ConfigError, match=match):
        Trainer(cfg, model=tiny_model(), train_dataset=TokenWindows(), **kwargs).train()
    assert not (tmp_path / "ckpt").exists()


def test_bad_runs_fail_before_the_first_step(tmp_path):
    class Tok:
        vocab_size = 1000

    _fails_before_training(tmp_path, "max_lr", cfg={"max_lr": -0.1})
    _fails_before_training(tmp_path, "window_size", cfg={"window_size": 65})
    _fails_before_training(tmp_path, "vocab_size", tokenizer=Tok())


def test_cli_flags_override_config_file(tmp_path):
    import argparse

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"max_lr": 1e-3, "batch_per_device": 8, "label_smoothing": 0.1}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--max_lr", "5e-4", "--grad_accum_steps", "4",
                              "--no-progress_bar", "--model_overrides", '{"vocab_size": 512}'])
    cfg, resume = build_config(args)
    assert (cfg.max_lr, cfg.batch_per_device, cfg.grad_accum_steps, cfg.label_smoothing) == (5e-4, 8, 4, 0.1)
    assert cfg.progress_bar is False and cfg.model_overrides == {"vocab_size": 512} and resume is None


def test_batches_are_pinned_only_when_bound_for_a_gpu(monkeypatch):
    """non_blocking copies are asynchronous only from page-locked memory, so a GPU run pins by default."""
    import torch

    from astrai.trainer.data import pins_batches

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pins_batches(TrainConfig())
    assert pins_batches(TrainConfig(device="cuda:0"))
    assert not pins_batches(TrainConfig(device="cpu"))
    assert not pins_batches(TrainConfig(pin_memory=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not pins_batches(TrainConfig())
