"""AutoTokenizer.train takes files or texts, and never mistakes one for the other."""

import pytest

from astrai.errors import DataError
from astrai.tokenize import AutoTokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog"] * 20 + ["小模型也能学会分词"] * 20


def test_a_list_of_texts_trains_like_the_same_lines_in_a_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    from_texts = AutoTokenizer.train(TEXTS, 300, show_progress=False)
    from_file = AutoTokenizer.train([str(corpus)], 300, show_progress=False)
    from_iterator = AutoTokenizer.train(iter(TEXTS), 300, show_progress=False)
    encoded = from_texts.encode("the quick brown fox")
    assert len(encoded) < 12  # 19 bytes without merges: merges were learnt from the texts, not from their file names
    assert encoded == from_iterator.encode("the quick brown fox")
    assert from_file.decode(from_file.encode("小模型也能学会分词")) == "小模型也能学会分词"
    assert len(from_file.encode("the quick brown fox")) == len(encoded)


def test_paths_and_texts_are_not_confused(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS), encoding="utf-8")
    with pytest.raises(DataError, match="mix file paths"):
        AutoTokenizer.train([str(corpus), "some text"], 300, show_progress=False)
    with pytest.raises(DataError, match="missing.txt: tokenizer training source not found"):
        AutoTokenizer.train([str(corpus), str(tmp_path / "missing.txt")], 300, show_progress=False)
