"""Training a byte-level BPE vocabulary with Hugging Face ``tokenizers``.

Byte-level means every string is first mapped to bytes, so nothing is ever
unknown and any Unicode text (Chinese, emoji, code) round-trips exactly. Digits
are split one by one (numbers tokenise consistently, which small models need for
arithmetic) and runs of CJK characters are kept together so merges can learn
common words.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from astrai.errors import DataError
from astrai.jsonl import iter_jsonl

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]

# Contractions, letter runs with one leading non-letter, single digits, punctuation
# runs, newlines, and other whitespace (the GPT-4/Qwen family of splits).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_empty_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _texts_from_record(record, where: str) -> Iterator[str]:
    """Every string a JSONL record contributes: text, chat turns, prompts and answers."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("text", "prompt", "chosen", "rejected", "response", "answer"):
        if isinstance(record.get(key), str):
            yield record[key]
    for message in record.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            yield message["content"]


def iter_texts(paths: Iterable[str | Path]) -> Iterator[str]:
    """Texts from .txt files (line by line) and .jsonl files (their string fields)."""
    for source in paths:
        path = Path(source)
        if not path.is_file():
            raise DataError(f"{path}: tokenizer training source not found (give .txt or .jsonl files)")
        if path.suffix in (".jsonl", ".json"):
            for where, record in iter_jsonl(path):
                yield from _texts_from_record(record, where)
        else:
            with open(path, encoding="utf-8") as handle:
                yield from handle


TEXT_FILE_SUFFIXES = (".txt", ".jsonl", ".json")


def names_a_file(source: str | Path) -> bool:
    """Whether a source is meant as a file: a Path, an existing path, or one word that reads as a path
    (a separator or a .txt/.jsonl suffix), so a mistyped file name is reported instead of trained on."""
    if isinstance(source, Path):
        return True
    if Path(source).exists():
        return True
    one_word = source.strip() == source and not any(c.isspace() for c in source)
    return one_word and ("/" in source or "\\" in source or source.endswith(TEXT_FILE_SUFFIXES))


def source_texts(sources) -> Iterator[str]:
    """The texts of ``sources``: one path, a list of paths, a list of texts, or any iterable of texts."""
    if isinstance(sources, (str, Path)):
        return iter_texts([sources])
    if not isinstance(sources, (list, tuple)):
        return (str(s) for s in sources)
    if not all(isinstance(s, (str, Path)) for s in sources):
        raise DataError("tokenizer training sources: give file paths or strings of text")
    files = [names_a_file(s) for s in sources]
    if all(files):
        return iter_texts(sources)
    if any(files):
        named = [str(s) for s, is_file in zip(sources, files) if is_file][:3]
        raise DataError(f"tokenizer training sources mix file paths ({', '.join(named)}) with texts; "
                        f"give a list of paths or a list of texts")
    return iter(sources)


def train_tokenizer(sources, vocab_size: int, special_tokens: list[str] | None = None,
                    show_progress: bool = True, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer.

    ``sources``: a path, a list of paths (.txt, .jsonl), a list of texts, or any other
    iterable of strings (taken as the texts themselves).
    """
    special_tokens = list(special_tokens) if special_tokens is not None else list(SPECIAL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise DataError(f"vocab_size {vocab_size} is too small: a byte-level vocabulary needs at least "
                        f"{len(alphabet) + len(special_tokens)} entries (256 bytes + special tokens)")
    tokenizer = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
                                  special_tokens=special_tokens, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(source_texts(sources), trainer=trainer)
    if tokenizer.get_vocab_size() <= len(special_tokens):
        raise DataError("tokenizer training saw no text: check the sources")
    bos = "<|bos|>"
    if bos in special_tokens:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tokenizer
