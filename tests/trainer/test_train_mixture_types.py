"""Mixtures whose entries name their own dataset type: pre-training text replayed in SFT."""

import json

import pytest
import torch
from astrai.config import TrainConfig, preset
from astrai.dataset import PreprocessOptions, run_preprocess
from astrai.errors import ConfigError, DataError
from astrai.model import AutoModel
from astrai.trainer import TrainCallback, Trainer
from astrai.trainer.data import resolve_data


def preprocess(inputs, output, tokenizer_dir, **options) -> None:
    run_preprocess(PreprocessOptions(inputs=[str(p) for p in inputs], output=str(output), tokenizer=str(tokenizer_dir),
                                     show_progress=False, **options))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, bundled_data, tokenizer_dir):
    root = tmp_path_factory.mktemp("mixture")
    texts = root / "texts.jsonl"
    with open(bundled_data / "pretrain" / "train.jsonl", encoding="utf-8") as src:
        texts.write_text("".join(next(src) for _ in range(40)), encoding="utf-8")
    chats = root / "chats.jsonl"
    with open(bundled_data / "sft" / "train.jsonl", encoding="utf-8") as src:
        chats.write_text("".join(next(src) for _ in range(60)), encoding="utf-8")
    preprocess([texts], root / "seq", tokenizer_dir, train_type="seq")
    preprocess([texts], root / "seq_doc_mask", tokenizer_dir, train_type="seq", doc_mask="on")
    preprocess([chats], root / "sft", tokenizer_dir, train_type="sft")
    return root


def sft_config(tmp_path, datasets, **overrides) -> TrainConfig:
    base = dict(train_type="sft", datasets=datasets, batch_per_device=2, window_size=32, max_steps=2, max_lr=1e-3,
                warmup_ratio=0.0, ckpt_dir=str(tmp_path / "ckpt"), progress_bar=False, save_final_model=False,
                random_seed=3)
    base.update(overrides)
    return TrainConfig(**base)


class Losses(TrainCallback):
    def __init__(self):
        self.losses = []

    def on_optimizer_step(self, context):
        self.losses.append(context.loss)


def test_seq_source_in_sft_counts_every_token(prepared, tmp_path):
    data = resolve_data(sft_config(tmp_path, [{"path": str(prepared / "sft"), "rate": 0.7},
                                              {"path": str(prepared / "seq"), "rate": 0.3, "type": "seq"}]))
    chat, text = data.train_sources
    assert 0 < int(chat[0]["loss_mask"].sum()) < 32  # a conversation counts only its replies
    for i in range(len(text)):
        item = text[i]
        assert item["loss_mask"].tolist() == [1] * 32 and set(item) == set(chat[0])


def test_sft_on_replayed_text_trains_exactly_like_pretraining(prepared, tmp_path, tokenizer):
    """An SFT run on a 'seq' source follows the same losses as a SEQ run on that data."""
    vocab = tokenizer.vocab_size
    runs = {}
    for kind, datasets in (("sft", [{"path": str(prepared / "seq"), "type": "seq"}]),
                           ("seq", [{"path": str(prepared / "seq")}])):
        losses = Losses()
        cfg = sft_config(tmp_path / kind, datasets, train_type=kind, max_steps=3)
        torch.manual_seed(0)
        model = AutoModel.from_config(preset("tiny", vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                             dim_ffn=64, max_len=64))
        Trainer(cfg, callbacks=[losses], model=model).train()
        runs[kind] = losses.losses
    assert len(runs["sft"]) == 3 and all(torch.isfinite(torch.tensor(runs["sft"])))
    assert runs["sft"] == pytest.approx(runs["seq"], rel=1e-6)


def test_mixture_type_errors_name_the_entry(prepared, tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="datasets.*entry 1: unknown type 'text'"):
        sft_config(tmp_path, [{"path": str(prepared / "sft")}, {"path": str(prepared / "seq"), "type": "text"}]).validate()
    with pytest.raises(DataError, match=r"entry 1 .*a 'sft' source cannot feed a 'seq' run"):
        resolve_data(sft_config(tmp_path, [{"path": str(prepared / "seq")},
                                           {"path": str(prepared / "sft"), "type": "sft"}], train_type="seq"))
    with pytest.raises(DataError, match="seq_doc_mask gives .*doc_ids.* preprocess them with the same"):
        resolve_data(sft_config(tmp_path, [{"path": str(prepared / "sft")},
                                           {"path": str(prepared / "seq_doc_mask"), "type": "seq"}]))


def test_cli_takes_a_typed_mixture(prepared, tmp_path, tokenizer):
    from astrai.cli import main

    model_dir = tmp_path / "model"
    assert main(["model", "create", "--preset", "tiny", "--out", str(model_dir),
                 "--vocab_size", str(tokenizer.vocab_size)]) == 0
    mix = [{"path": str(prepared / "sft"), "rate": 0.5}, {"path": str(prepared / "seq"), "rate": 0.5, "type": "seq"}]
    assert main(["train", "--train_type", "sft", "--datasets", json.dumps(mix), "--param_path", str(model_dir),
                 "--window_size", "32", "--batch_per_device", "2", "--max_steps", "2", "--ckpt_dir",
                 str(tmp_path / "run"), "--no-progress_bar"]) == 0
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
