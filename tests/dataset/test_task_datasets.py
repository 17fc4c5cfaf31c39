"""SFT masks cover exactly the assistant tokens; packing keeps documents whole and apart;
DPO and GRPO rows keep their boundaries and float rewards."""

import numpy as np
import pytest
import torch
from helpers_dataset import preprocess, write_jsonl

from astrai.cli import main
from astrai.dataset import DatasetFactory, create_storage

CONVERSATIONS = [
    [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "讲个故事"},
     {"role": "assistant", "content": "从前有座山。"}],
    [{"role": "user", "content": "What is a computer?"}, {"role": "assistant", "content": "A machine that computes."}],
] * 4


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    records = [{"messages": m} for m in CONVERSATIONS] + [{"prompt": "Say yes.", "response": "Yes."}]
    return write_jsonl(tmp_path_factory.mktemp("sft") / "chat.jsonl", records)


def expected_sft(tokenizer):
    convs = CONVERSATIONS + [[{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}]]
    return [tokenizer.encode_chat(m) for m in convs], convs


def test_sft_stream_masks_exactly_the_assistant_tokens(sft_file, tokenizer, tokenizer_dir, tmp_path):
    preprocess([sft_file], tmp_path / "sft", tokenizer_dir, train_type="sft")
    encoded, convs = expected_sft(tokenizer)
    storage = create_storage("mmap").load(tmp_path / "sft")
    stored = storage.fetch(0, len(storage))
    assert stored["sequence"].tolist() == [t for ids, _ in encoded for t in ids]
    assert stored["loss_mask"].tolist() == [m for _, mask in encoded for m in mask]
    ids, mask = encoded[1]
    learnt = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert learnt == "Hi, how can I help?<|im_end|>从前有座山。<|im_end|>"

    dataset = DatasetFactory.load("sft", tmp_path / "sft", 32)
    item = dataset[1]
    assert set(item) == {"input_ids", "target_ids", "loss_mask"}
    assert torch.equal(item["loss_mask"], stored["loss_mask"][33:65].long())  # mask is aligned with the targets
    full_targets = torch.cat([dataset[i]["target_ids"][dataset[i]["loss_mask"] == 1] for i in range(len(dataset))])
    assert tokenizer.decode(full_targets.tolist(), skip_special_tokens=False).startswith("7<|im_end|>Hi, how")


@pytest.mark.parametrize("packing", ["best_fit", "none"])
def test_packed_rows_hold_whole_documents_kept_apart(sft_file, tokenizer, tokenizer_dir, tmp_path, packing):
    explicit = {"doc_mask": "on", "position_ids": "reset"} if packing == "none" else {}  # best_fit does this by default
    summary = preprocess([sft_file], tmp_path / packing, tokenizer_dir, train_type="sft", packing=packing, seq_len=127,
                         **explicit)
    encoded, _ = expected_sft(tokenizer)
    dataset = DatasetFactory.load("sft", tmp_path / packing, 127)
    assert summary["documents"] == len(encoded) and len(dataset) == summary["rows"]
    if packing == "none":
        assert len(dataset) == len(encoded)
    else:
        assert len(dataset) < len(encoded)
    seen = []
    storage = dataset.storage
    for row in range(len(dataset)):
        window = storage.fetch(row * 128, (row + 1) * 128)
        item = dataset[row]
        assert torch.equal(item["doc_ids"], window["doc_ids"][:-1].long())
        for doc in torch.unique_consecutive(window["doc_ids"]):
            where = (window["doc_ids"] == doc).nonzero().flatten()
            ids, mask = window["sequence"][where].tolist(), window["loss_mask"][where].tolist()
            if mask == [0] * len(mask) and set(ids) == {tokenizer.pad_id}:
                continue  # padding: never trained on
            seen.append((ids, mask))
            inside = where[where < 127]
            assert item["position_ids"][inside].tolist() == list(range(len(inside)))  # positions restart per document
    assert sorted(map(str, seen)) == sorted(map(str, encoded))  # each document id holds exactly one whole conversation


def test_plain_text_rows_split_long_documents_and_ignore_padding(tokenizer, tokenizer_dir, tmp_path):
    texts = ["short one", "a much longer document " * 12, "中文的文档"]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    summary = preprocess([path], tmp_path / "rows", tokenizer_dir, packing="best_fit", seq_len=31)
    assert summary["split"] == 1
    dataset = DatasetFactory.load("seq", tmp_path / "rows", 31)
    stored = dataset.storage.fetch(0, len(dataset.storage))
    real = stored["sequence"][stored["loss_mask"] == 1].tolist()
    expected = [tokenizer.encode(t) + [tokenizer.eos_id] for t in texts]
    assert sorted(real) == sorted(t for doc in expected for t in doc)  # nothing lost, only padding added
    for i in range(len(dataset)):
        item = dataset[i]
        padded = stored["loss_mask"][i * 32 + 1:(i + 1) * 32] == 0
        assert (item["target_ids"][padded] == -100).all() and (item["target_ids"][~padded] >= 0).all()


PREFERENCES = [
    {"prompt": [{"role": "user", "content": "2+2="}], "chosen": "4", "rejected": "5"},
    {"prompt": "Translate 猫: ", "chosen": "cat", "rejected": "dog"},
]


def test_dpo_rows_keep_prompt_response_boundaries(tokenizer, tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", PREFERENCES)
    preprocess([path], tmp_path / "dpo", tokenizer_dir, train_type="dpo", seq_len=40, format="h5")
    dataset = DatasetFactory.load("dpo", tmp_path / "dpo", 40)
    assert len(dataset) == 2
    chat = dataset[0]
    prompt = tokenizer.apply_chat_template(PREFERENCES[0]["prompt"], add_generation_prompt=True)
    for side, answer in (("chosen", "4"), ("rejected", "5")):
        ids, mask = chat[side], chat[f"{side}_mask"]
        n_prompt = len(tokenizer.encode(prompt))
        assert ids[:n_prompt].tolist() == tokenizer.encode(prompt) and not mask[:n_prompt].any()
        assert tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == answer + "<|im_end|>"
        assert (ids[mask.nonzero().max() + 1:] == tokenizer.pad_id).all()
    plain = dataset[1]
    assert tokenizer.decode(plain["chosen"][plain["chosen_mask"] == 1].tolist(), skip_special_tokens=False) == "cat<|eos|>"
    assert tokenizer.decode(plain["rejected"][plain["rejected_mask"] == 0].tolist()) == "Translate 猫: "


def test_dpo_pairs_whose_answer_is_cut_away_are_skipped(tokenizer_dir, tmp_path):
    long_prompt = {"prompt": "word " * 80, "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "pairs.jsonl", PREFERENCES + [long_prompt])
    summary = preprocess([path], tmp_path / "dpo", tokenizer_dir, train_type="dpo", seq_len=24)
    assert summary["skipped"] == {"response truncated away": 1} and summary["written"] == 2
    summary = preprocess([path], tmp_path / "dpo_left", tokenizer_dir, train_type="dpo", seq_len=24, truncation="left")
    assert summary["skipped"] == {} and summary["written"] == 3


def test_grpo_rows_keep_rewards_and_boundaries(tokenizer, tokenizer_dir, tmp_path):
    records = [{"prompt": [{"role": "user", "content": "1+2="}], "responses": ["3", "4", "three"],
                "rewards": [1.0, -0.5, 0.125]},
               {"prompt": "9+0=", "response": "9", "reward": 0.7}]
    path = write_jsonl(tmp_path / "scored.jsonl", records)
    summary = preprocess([path], tmp_path / "grpo", tokenizer_dir, train_type="grpo", seq_len=48, max_prompt_len=20,
                         format="json")
    assert summary["responses"] == 4
    dataset = DatasetFactory.load("grpo", tmp_path / "grpo", 48)
    rewards = [dataset[i]["rewards"] for i in range(len(dataset))]
    assert all(r.dtype == torch.float32 and r.dim() == 0 for r in rewards)
    assert [r.item() for r in rewards] == pytest.approx([1.0, -0.5, 0.125, 0.7])
    first = dataset[0]
    assert first["prompts"].shape == (20,) and first["responses"].shape == (28,)
    prompt_text = tokenizer.apply_chat_template(records[0]["prompt"], add_generation_prompt=True)
    assert first["prompts"][first["prompt_mask"] == 1].tolist() == tokenizer.encode(prompt_text)
    assert first["prompt_mask"][-1] == 1 and first["prompt_mask"][0] == 0  # left-padded: prompt ends at the boundary
    answers = [tokenizer.decode(dataset[i]["responses"][dataset[i]["masks"] == 1].tolist(), skip_special_tokens=False)
               for i in range(4)]
    assert answers == ["3<|im_end|>", "4<|im_end|>", "three<|im_end|>", "9<|eos|>"]


def test_grpo_prompt_only_data_for_online_rollouts(bundled_data, tokenizer_dir, tmp_path):
    summary = preprocess([bundled_data / "grpo" / "arithmetic.jsonl"], tmp_path / "prompts", tokenizer_dir,
                         train_type="grpo", seq_len=32)
    dataset = DatasetFactory.load("grpo", tmp_path / "prompts", 32)
    assert len(dataset) == summary["prompts"] == 500
    assert set(dataset[0]) == {"prompts", "prompt_mask"}
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    assert next(iter(loader))["prompts"].shape == (8, 16)
    assert np.all(dataset.storage.fetch(0, 16, ["prompt_mask"])["prompt_mask"].numpy()[-3:] == 1)


def test_grpo_prompts_cut_from_the_left_are_counted_and_named(tokenizer, tokenizer_dir, tmp_path, capsys):
    """A prompt longer than the row keeps its end (next to the answer), is counted, and the
    command says how to make room: a reward that reads the question from the prompt would
    otherwise fail, or a chat template's system prompt vanish, without a word."""
    records = [{"prompt": [{"role": "system", "content": "You are a careful assistant who checks every sum."},
                           {"role": "user", "content": "What is 23+45?"}]},
               {"prompt": "2+2="}]
    path = write_jsonl(tmp_path / "prompts.jsonl", records)
    long_ids = tokenizer.encode(tokenizer.apply_chat_template(records[0]["prompt"], add_generation_prompt=True))
    width = len(long_ids) - 5
    out = tmp_path / "grpo"
    assert main(["preprocess", str(path), "-o", str(out), "--tokenizer", str(tokenizer_dir), "--train_type", "grpo",
                 "--seq_len", str(width + 8), "--max_prompt_len", str(width), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert f"1 of 2 GRPO prompts were longer than {width} tokens" in captured.err and "--max_prompt_len" in captured.err
    first = DatasetFactory.load("grpo", out, width + 8)[0]
    assert first["prompts"][first["prompt_mask"] == 1].tolist() == long_ids[-width:]
    # room for the whole prompt: nothing cut, nothing said
    assert main(["preprocess", str(path), "-o", str(tmp_path / "whole"), "--tokenizer", str(tokenizer_dir),
                 "--train_type", "grpo", "--seq_len", str(len(long_ids) + 8), "--max_prompt_len", str(len(long_ids)),
                 "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "prompts_truncated" not in captured.out and "warning" not in captured.err
