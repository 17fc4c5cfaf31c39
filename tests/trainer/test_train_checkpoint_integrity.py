"""Checkpoints: atomic under kill -9, and truncated or tampered ones are refused clearly."""

import json

import pytest
import torch

from astrai.errors import CheckpointError
from astrai.serialization import Checkpoint, latest_checkpoint


def saved(tmp_path):
    tied = torch.randn(4, 3)
    state = {"embed.weight": tied, "head.weight": tied, "norm.weight": torch.ones(3)}
    extra = {"optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}}
    path = Checkpoint(state, 1, 7, extra, {"tokens_seen": 99}).save(tmp_path / "step_00000007")
    return path, state


def test_round_trip_keeps_tied_weights_and_extra(tmp_path):
    path, state = saved(tmp_path)
    ckpt = Checkpoint.load(path)
    assert (ckpt.epoch, ckpt.iteration, ckpt.meta) == (1, 7, {"tokens_seen": 99})
    for name, tensor in state.items():
        assert torch.equal(ckpt.state_dict[name], tensor)
    assert ckpt.extra["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "meta"])
def test_damaged_checkpoint_is_refused_with_the_file_named(tmp_path, damage):
    path, _ = saved(tmp_path)
    weights = path / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "delete":
        (path / "optimizer.pt").unlink()
    else:
        (path / "meta.json").write_text(json.dumps({"epoch": 1})[:-3])
    with pytest.raises(CheckpointError) as info:
        Checkpoint.load(path)
    expected = {"truncate": "model.safetensors", "flip": "model.safetensors", "delete": "optimizer.pt",
                "meta": "meta.json"}[damage]
    assert expected in str(info.value)


def test_kill_9_during_save_leaves_previous_checkpoint_loadable(tmp_path, killed_save):
    killed_save(tmp_path)
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())  # the half-written save
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000001"
    ckpt = Checkpoint.load(latest)
    assert torch.equal(ckpt.state_dict["w"], torch.arange(6.0).reshape(2, 3))
    assert ckpt.extra["optimizer"] == {"lr": 0.1}
