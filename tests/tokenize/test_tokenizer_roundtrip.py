"""The tokenizer is lossless on any Unicode text, streams without half characters,
and survives save/load; a plain Hugging Face tokenizer.json loads too."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from astrai.commands.tokenizer import add_arguments
from astrai.errors import CheckpointError, DataError
from astrai.tokenize import SPECIAL_TOKENS, AutoTokenizer
from astrai.tokenize.cli import run

MIXED = "In the beginning 起初，神创造天地。 🙂👍🏽 x = 42\n\tdef f(): return 'ok'  \u00e9\u0301"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_decode_inverts_encode_for_any_unicode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    if not any(t in text for t in SPECIAL_TOKENS):  # special-token literals are parsed as specials, like HF
        assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60) | st.lists(st.sampled_from(["<|im_end|>", "你", "🙂", "a b", "\n"])).map("".join))
def test_stream_decoding_concatenates_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    for skip in (True, False):
        decoder = tokenizer.stream_decoder(skip_special_tokens=skip)
        pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_back_partial_characters(tokenizer):
    ids = tokenizer.encode("🙂")  # 4 bytes, unlikely to be one token in a 1000-entry vocabulary
    assert len(ids) > 1
    decoder = tokenizer.stream_decoder()
    assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1]) == "🙂"


def test_batch_encode_matches_single_and_specials(tokenizer):
    texts = ["hello world", "你好，世界", "", MIXED]
    assert tokenizer.encode(texts) == [tokenizer.encode(t) for t in texts]
    assert tokenizer.encode("hi", add_special_tokens=True)[0] == tokenizer.bos_id
    ids = {tokenizer.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")}
    assert None not in ids and len(ids) == 5
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == tuple(
        tokenizer.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>"))
    assert tokenizer.stop_ids == sorted([tokenizer.eos_id, tokenizer.token_to_id("<|im_end|>")])
    assert tokenizer.encode("<|im_end|>") == [tokenizer.token_to_id("<|im_end|>")]
    assert tokenizer.decode(tokenizer.encode("a<|eos|>b")) == "ab"
    assert 900 <= tokenizer.vocab_size <= 1000
    with pytest.raises(DataError):
        tokenizer.encode(["ok", 3])


def test_save_and_load_preserve_everything(tokenizer, tokenizer_dir):
    loaded = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert loaded.encode(MIXED) == tokenizer.encode(MIXED)
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.stop_ids) == \
        (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.stop_ids)
    assert loaded.chat_template.template_str == tokenizer.chat_template.template_str
    assert AutoTokenizer.from_pretrained(tokenizer_dir / "tokenizer.json").encode(MIXED) == tokenizer.encode(MIXED)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_token_bytes_concatenate_to_the_utf8_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == tokenizer.decode(ids, skip_special_tokens=False).encode()


def test_cli_encode_shows_partial_characters_as_bytes(tokenizer, tokenizer_dir, capsys):
    """A character split across tokens is shown as its bytes, not as replacement characters."""
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = "饕餮 and 🙂"  # rare in the corpus: byte pieces in a 1000-entry vocabulary
    assert run(parser.parse_args(["encode", str(tokenizer_dir), text])) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["ids"] == tokenizer.encode(text)
    assert not any("\ufffd" in piece for piece in shown["pieces"])
    assert any(piece.startswith("<0x") for piece in shown["pieces"])
    assert " and" in shown["pieces"] or "and" in "".join(shown["pieces"])
    hex_or_text = re.compile(r"<0x([0-9A-F]{2})>|(.)", re.S)
    rebuilt = b"".join(bytes([int(m[1], 16)]) if m[1] else m[2].encode()
                       for piece in shown["pieces"] for m in hex_or_text.finditer(piece))
    assert rebuilt == text.encode()
    with pytest.raises(DataError, match="outside the vocabulary"):
        tokenizer.token_bytes(tokenizer.vocab_size + 5)


def test_plain_hugging_face_tokenizer_json_loads(tmp_path):
    """A tokenizer.json from elsewhere, with HF-style {"content": ...} special tokens."""
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>", "</s>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode("ab a") == [4, 2]
    assert loaded.eos_id is None and loaded.stop_ids == []
    assert loaded.token_bytes(4) == b"ab"  # not byte-level: the token's decoded text
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>"}))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.stop_ids) == (0, 1, [1])


def test_missing_or_broken_tokenizer_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        AutoTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        AutoTokenizer.from_pretrained(tmp_path)


def test_cli_trains_from_txt_and_jsonl(tmp_path, bundled_data):
    text_file = tmp_path / "poems.txt"
    text_file.write_text("床前明月光，疑是地上霜。\nThe quick brown fox.\n" * 50, encoding="utf-8")
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["train", str(text_file), str(bundled_data / "sft" / "valid.jsonl"),
                              "--out", str(tmp_path / "tok"), "--vocab_size", "400"])
    assert run(args) == 0
    trained = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert trained.vocab_size == 400
    assert trained.decode(trained.encode("床前明月光")) == "床前明月光"
    with pytest.raises(DataError, match="too small"):
        AutoTokenizer.train([str(text_file)], 100)
    with pytest.raises(DataError, match="not found"):
        AutoTokenizer.train([str(tmp_path / "missing.txt")], 400)
