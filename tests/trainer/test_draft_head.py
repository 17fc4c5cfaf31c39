"""Draft heads: `train_type draft_head` trains a small head on a frozen target's greedy choices;
the head drafts, saves, loads (checked against its target), resumes exactly, and a trained
head's drafts are accepted far more often than an untrained one's."""

import json
from pathlib import Path

import pytest
import torch
from trainer_helpers import VOCAB, TokenWindows, config, tiny_model

from astrai.cli import main
from astrai.config import preset
from astrai.errors import ConfigError
from astrai.eval.draft_acceptance import draft_acceptance, greedy_continuation
from astrai.model import AutoModel
from astrai.model.draft_head import DraftHead, load_draft_head
from astrai.model.quantized import QuantizedLinear
from astrai.serialization import Checkpoint, list_checkpoints
from astrai.trainer import Trainer
from astrai.trainer.builder import TrainContextBuilder

# an untied random target: its greedy choices depend on the context, not just a copy of the input
TARGET = dict(tie_weight=False)
STEPS = 150
# the trained head below accepts ~2.7 of 3 drafted tokens per verify step; an untrained one ~0
ACCEPTED_FLOOR = 1.5


def draft_config(tmp_path, **overrides):
    base = dict(train_type="draft_head", max_steps=STEPS, max_lr=3e-3, strategy_kwargs={"draft_vocab": VOCAB})
    base.update(overrides)
    return config(tmp_path, **base)


def held_out(target, n=8, prompt_len=8, new_tokens=24):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist() for _ in range(n)]
    return prompts, [greedy_continuation(target, p, new_tokens) for p in prompts]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("draft_head")
    target = tiny_model(**TARGET)
    Trainer(draft_config(tmp), model=target, train_dataset=TokenWindows(n=64, window=16)).train()
    return tmp, target


def losses(tmp):
    lines = (Path(tmp) / "ckpt" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_head_trains_and_its_drafts_are_accepted(trained):
    tmp, target = trained
    curve = losses(tmp)
    assert len(curve) == STEPS
    assert sum(curve[-10:]) / 10 < 0.5 * curve[0]
    head = load_draft_head(Path(tmp) / "ckpt" / "final", target)
    prompts, continuations = held_out(target)
    acceptance = draft_acceptance(head, prompts, continuations, k=3)
    untrained = draft_acceptance(DraftHead.for_target(target, head.draft_ids.clone()), prompts, continuations, k=3)
    assert acceptance.mean_accepted >= ACCEPTED_FLOOR, acceptance.to_dict()
    assert untrained.mean_accepted < 0.5, untrained.to_dict()
    assert len(acceptance.per_position) == 3
    assert acceptance.per_position == sorted(acceptance.per_position, reverse=True)


def test_an_int8_head_drafts_as_well_as_the_fp32_one(trained):
    """What the engine serves beside a quantized target: the head's linears in int8 blocks,
    whose acceptance survives the rounding."""
    tmp, target = trained
    final = Path(tmp) / "ckpt" / "final"
    prompts, continuations = held_out(target)
    fp32 = draft_acceptance(load_draft_head(final, target), prompts, continuations, k=3)
    head = load_draft_head(final, target).quantize()
    assert all(isinstance(getattr(head, n), QuantizedLinear) for n in ("fuse", "gate_proj", "up_proj", "down_proj",
                                                                        "out_proj"))
    int8 = draft_acceptance(head, prompts, continuations, k=3)
    assert int8.mean_accepted >= ACCEPTED_FLOOR and abs(int8.mean_accepted - fp32.mean_accepted) < 0.2, int8.to_dict()


def test_target_stays_frozen_and_only_the_head_is_checkpointed(trained):
    tmp, target = trained
    assert torch.equal(target.lm_head.weight.cpu(), tiny_model(**TARGET).lm_head.weight)
    state = Checkpoint.load(list_checkpoints(Path(tmp) / "ckpt")[-1]).state_dict
    head = load_draft_head(Path(tmp) / "ckpt" / "final", target)
    assert set(state) == set(DraftHead(head.config).state_dict()) and "draft_ids" in state


def test_draft_returns_k_target_ids(trained):
    tmp, target = trained
    head = load_draft_head(Path(tmp) / "ckpt" / "final", target)
    ids = torch.tensor([[3, 17, 42]], device=target.embed_tokens.weight.device)  # where the trainer put it
    hidden = target(ids, compute_logits=False)["hidden_states"][0]
    guesses = head.draft(hidden[-1], 5, k=4)
    assert len(guesses) == 4 and all(isinstance(t, int) and 0 <= t < VOCAB for t in guesses)
    assert set(guesses) <= set(head.draft_ids.tolist())
    rows = head.draft_batch(hidden, torch.tensor([5, 6, 7]), k=4)
    assert rows[2] == head.draft(hidden[2], 7, k=4)
    with pytest.raises(ConfigError, match="k must be at least 1"):
        head.draft(hidden[-1], 5, k=0)


def test_reduced_vocabulary_maps_back_to_target_ids(tmp_path):
    target = tiny_model(**TARGET)
    data = TokenWindows(n=16, window=16)
    context = TrainContextBuilder(draft_config(tmp_path, strategy_kwargs={"draft_vocab": 16}), model=target,
                                  train_dataset=data).build()
    head = context.model
    counts = torch.bincount(data.tokens[:, 1:].flatten(), minlength=VOCAB)
    assert head.draft_ids.numel() == 16 and head.out_proj.weight.shape == (16, 32)
    assert counts[head.draft_ids.cpu()].min() >= counts.sort(descending=True).values[15]
    hidden = torch.randn(2, 32, device=head.draft_ids.device)
    rows = head.draft_batch(hidden, torch.tensor([1, 2]), 3)
    assert all(t in set(head.draft_ids.tolist()) for row in rows for t in row)


def test_resume_matches_an_uninterrupted_run(tmp_path):
    data = TokenWindows(n=32, window=16)
    straight = draft_config(tmp_path / "a", max_steps=6, ckpt_interval=3)
    Trainer(straight, model=tiny_model(**TARGET), train_dataset=data).train()
    halfway = list_checkpoints(tmp_path / "a" / "ckpt")[0]
    resumed = draft_config(tmp_path / "b", max_steps=6, ckpt_interval=3)
    Trainer(resumed, model=tiny_model(**TARGET), train_dataset=data).train(checkpoint=str(halfway))
    assert Checkpoint.load(halfway).meta["step"] == 3
    assert losses(tmp_path / "a")[3:] == losses(tmp_path / "b")
    a = load_draft_head(tmp_path / "a" / "ckpt" / "final", tiny_model(**TARGET)).state_dict()
    b = load_draft_head(tmp_path / "b" / "ckpt" / "final", tiny_model(**TARGET)).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_head_refuses_a_target_it_was_not_trained_for(trained):
    tmp, target = trained
    final = Path(tmp) / "ckpt" / "final"
    with pytest.raises(ConfigError, match="vocab_size 64, but this target has vocab_size 80"):
        load_draft_head(final, AutoModel.from_config(preset("tiny", vocab_size=80, dim=32, n_layers=2, n_heads=4)))
    with pytest.raises(ConfigError, match="dim 32, but this target has dim 48"):
        load_draft_head(final, AutoModel.from_config(preset("tiny", vocab_size=64, dim=48, n_layers=2, n_heads=4)))
    with pytest.raises(ConfigError, match="another model of the same shape"):
        load_draft_head(final, tiny_model(seed=7, **TARGET))
    with pytest.raises(ConfigError, match="not a draft head directory"):
        load_draft_head(tmp, target)
    # the same weights at another precision are the same target
    load_draft_head(final, tiny_model(**TARGET).to(torch.bfloat16))


@pytest.mark.parametrize("kwargs, message", [
    ({"draft_vocab": 0}, "draft_vocab: must be a positive integer"),
    ({"draft_steps": "3"}, "draft_steps: must be a positive integer"),
    ({"feature_weight": -1.0}, "feature_weight: must be >= 0"),
    ({"draft_vocabulary": 64}, "draft_vocabulary unknown to draft_head training"),
])
def test_bad_settings_are_refused_before_training(tmp_path, kwargs, message):
    cfg = draft_config(tmp_path, strategy_kwargs=kwargs)
    with pytest.raises(ConfigError, match=message):
        TrainContextBuilder(cfg, model=tiny_model(**TARGET), train_dataset=TokenWindows(n=8, window=16)).build()


def test_astrai_train_writes_a_draft_head_and_refuses_bad_settings(tmp_path, bundled_data, tokenizer_dir, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join((bundled_data / "sft" / "train.jsonl").read_text(encoding="utf-8").splitlines(True)[:40]),
                     encoding="utf-8")
    assert main(["preprocess", str(chats), "-o", str(tmp_path / "sft"), "--tokenizer", str(tokenizer_dir),
                 "--train_type", "sft", "--packing", "best_fit", "--seq_len", "32", "--quiet"]) == 0
    target = AutoModel.from_config(preset("tiny", vocab_size=1024, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                          dim_ffn=64, max_len=64))
    target.save_pretrained(tmp_path / "target")
    args = ["train", "--train_type", "draft_head", "--param_path", str(tmp_path / "target"),
            "--data_root_path", str(tmp_path / "sft"), "--window_size", "32", "--batch_per_device", "2",
            "--max_steps", "2", "--no-progress_bar", "--ckpt_dir", str(tmp_path / "run")]
    capsys.readouterr()
    assert main(args + ["--strategy_kwargs", '{"draft_vocab": 128}']) == 0
    assert "the trained draft head" in capsys.readouterr().out
    head = load_draft_head(tmp_path / "run" / "final", target)
    assert head.config.draft_vocab_size == 128
    assert main(args + ["--strategy_kwargs", '{"draft_steps": 0}', "--ckpt_dir", str(tmp_path / "bad")]) == 2
    assert "draft_steps: must be a positive integer" in capsys.readouterr().err
