"""A token shard whose length disagrees with meta.json is refused, naming the file and both sizes."""

import os

import pytest
from helpers_dataset import bundled_texts, preprocess, write_jsonl

from astrai.dataset import DatasetFactory, create_storage
from astrai.errors import DataError


@pytest.fixture
def dataset_dir(tmp_path, bundled_data, tokenizer_dir):
    raw = write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in bundled_texts(bundled_data, 10)])
    preprocess([raw], tmp_path / "ds", tokenizer_dir, shard_size=400)
    return tmp_path / "ds"


def test_truncated_mmap_shard_is_refused_with_file_and_both_sizes(dataset_dir):
    shard = dataset_dir / "sequence.00001.bin"
    full = shard.stat().st_size
    itemsize = create_storage("mmap").load(dataset_dir).fetch(0, 1)["sequence"].numpy().dtype.itemsize
    os.truncate(shard, full - 8 * itemsize)  # still a whole number of tokens: only meta.json can tell
    with pytest.raises(DataError) as err:
        create_storage("mmap").load(dataset_dir)
    message = str(err.value)
    assert str(shard) in message and str(full) in message and str(full - 8 * itemsize) in message
    with pytest.raises(DataError, match="sequence.00001.bin"):
        DatasetFactory.load("seq", dataset_dir, 16)


def test_longer_shard_than_recorded_is_refused_too(dataset_dir):
    shard = dataset_dir / "sequence.00000.bin"
    with open(shard, "ab") as handle:
        handle.write(bytes(shard.stat().st_size))
    with pytest.raises(DataError, match="sequence.00000.bin.*meta.json records"):
        create_storage("mmap").load(dataset_dir)


def test_intact_dataset_still_loads(dataset_dir):
    assert len(create_storage("mmap").load(dataset_dir)) > 0
