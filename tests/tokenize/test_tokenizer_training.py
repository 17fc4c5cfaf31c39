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


def test_digits_are_split_one_per_token_and_the_split_is_saved(tmp_path):
    """Numbers repeated often enough to be merged still encode digit by digit: the split is
    in the pre-tokenizer saved in tokenizer.json, so a loaded tokenizer splits them too."""
    texts = ["12+7=19 and 2024 was 12345 days"] * 50 + ["一共有123个学生，2024年"] * 50
    trained = AutoTokenizer.train(texts, 400, show_progress=False)
    trained.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for tokenizer in (trained, loaded):
        pieces = [tokenizer.token_bytes(i) for i in tokenizer.encode("12+7=19", add_special_tokens=False)]
        assert pieces == [b"1", b"2", b"+", b"7", b"=", b"1", b"9"]
        digits = [p for p in (tokenizer.token_bytes(i) for i in tokenizer.encode("12345 days", add_special_tokens=False))
                  if any(c in b"0123456789" for c in p)]
        assert digits == [b"1", b"2", b"3", b"4", b"5"]
        for text in ("12+7=19 and 2024 was 12345 days", "一共有123个学生，2024年", "x9y 0.5 ７８"):
            assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert r"|\\p{N}|" in (tmp_path / "tokenizer.json").read_text(encoding="utf-8")
