"""JSONL → every storage format → dataset windows reproduce the original token stream."""

import numpy as np
import pytest
import torch
from helpers_dataset import bundled_texts, preprocess, write_jsonl

from astrai.dataset import (BaseSegmentFetcher, DatasetFactory, MultiSegmentFetcher, create_storage, detect_format,
                            load_h5, load_json, save_h5, save_json)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, bundled_data, tokenizer):
    texts = bundled_texts(bundled_data, 40)
    path = write_jsonl(tmp_path_factory.mktemp("raw") / "corpus.jsonl", [{"text": t} for t in texts])
    stream = np.concatenate([tokenizer.encode(t) + [tokenizer.eos_id] for t in texts])
    return path, stream


@pytest.mark.parametrize("storage_format", ["mmap", "h5", "json"])
def test_windows_reproduce_the_token_stream(corpus, tokenizer_dir, tmp_path, storage_format):
    path, stream = corpus
    summary = preprocess([path], tmp_path / "ds", tokenizer_dir, format=storage_format, shard_size=997, batch_size=7)
    assert summary["records"] == 40 and summary["tokens"] == len(stream) and summary["shards"] > 3
    assert detect_format(tmp_path / "ds") == storage_format
    storage = create_storage(storage_format).load(tmp_path / "ds")
    assert storage.keys == ["sequence"] and len(storage) == len(stream)
    assert np.array_equal(storage.fetch(0, len(stream))["sequence"].numpy(), stream)

    window = 64
    dataset = DatasetFactory.load("seq", tmp_path / "ds", window)
    assert len(dataset) == (len(stream) - window - 1) // window + 1
    rebuilt = torch.cat([dataset[i]["input_ids"] for i in range(len(dataset))] + [dataset[len(dataset) - 1]["target_ids"][-1:]])
    assert np.array_equal(rebuilt.numpy(), stream[: len(rebuilt)])
    item = dataset[5]
    assert set(item) == {"input_ids", "target_ids"} and item["input_ids"].dtype == torch.int64
    assert torch.equal(item["input_ids"][1:], item["target_ids"][:-1])

    overlapping = DatasetFactory.load("seq", tmp_path / "ds", window, stride=17)
    for i in (0, 3, len(overlapping) - 1):
        assert np.array_equal(overlapping[i]["input_ids"].numpy(), stream[i * 17: i * 17 + window])


def test_worker_processes_give_identical_output(corpus, tokenizer_dir, tmp_path):
    path, stream = corpus
    preprocess([path], tmp_path / "mp", tokenizer_dir, num_workers=2, batch_size=5)
    storage = create_storage("mmap").load(tmp_path / "mp")
    assert np.array_equal(storage.fetch(0, len(storage))["sequence"].numpy(), stream)


def test_fetcher_stitches_segments_and_views_inside_one():
    segments = [np.arange(0, 5), np.arange(5, 6), np.arange(6, 20)]
    fetcher = BaseSegmentFetcher(segments)
    assert fetcher.total_length == 20 and fetcher.cum_lengths == [0, 5, 6, 20]
    for begin, end in [(0, 20), (3, 7), (5, 6), (6, 6), (19, 20)]:
        assert fetcher.fetch_array(begin, end).tolist() == list(range(begin, end))
    assert np.shares_memory(fetcher.fetch_array(7, 12), segments[2])
    with pytest.raises(IndexError):
        fetcher.fetch_array(10, 21)
    multi = MultiSegmentFetcher({"a": segments, "b": [np.arange(100, 120)]})
    both = multi.fetch_data(4, 8)
    assert both["a"].tolist() == [4, 5, 6, 7] and both["b"].tolist() == [104, 105, 106, 107]


def test_foreign_h5_and_json_files_load(tmp_path):
    tokens = np.arange(50, dtype=np.int32)
    h5_dir, json_dir = tmp_path / "h5", tmp_path / "json"
    h5_dir.mkdir(), json_dir.mkdir()
    save_h5(h5_dir / "a.h5", {"sequence": tokens[:30]})
    save_h5(h5_dir / "b.h5", {"sequence": tokens[30:]})
    save_json(json_dir / "a.json", {"sequence": tokens[:30]})
    (json_dir / "b.jsonl").write_text('{"sequence": [30, 31, 32]}\n{"sequence": %s}\n' % list(range(33, 50)))
    assert [a.tolist() for a in load_h5(h5_dir)["sequence"]] == [list(range(30)), list(range(30, 50))]
    assert sum(len(a) for a in load_json(json_dir)["sequence"]) == 50
    for path, fmt in ((h5_dir, "h5"), (json_dir, "json"), (h5_dir / "a.h5", "h5")):
        assert detect_format(path) == fmt
    for path in (h5_dir, json_dir):
        dataset = DatasetFactory.load("seq", path, 9)
        assert len(dataset) == 5 and dataset[4]["input_ids"].tolist() == list(range(36, 45))
