"""The tokenizer of a GGUF file's metadata: byte-level BPE vocabulary, merges, special tokens, chat template.

llama.cpp stores the tokenizer as lists (``tokenizer.ggml.tokens``/``merges``/``token_type``)
plus the name of the pre-tokenizer its merges were learned with (``tokenizer.ggml.pre``).
The lists rebuild a Hugging Face ``tokenizers`` BPE model directly; the name selects the
text splitting, which has to match or the same text gives other tokens. The splits
known here are the ones llama.cpp applies for each name: GPT-2's, SmolLM's (GPT-2's
after cutting digits apart), Llama 3's (numbers in runs of up to three digits) and
Qwen2's (single digits, NFC-normalised text). Anything else is refused rather than
tokenised differently from the model's training.
"""

from __future__ import annotations

import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from astrai.errors import CheckpointError
from astrai.model.gguf import GGUFMetadata, read_gguf

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types that are matched whole in text

# The word-splitting patterns of Llama 3 and Qwen2: contractions, letter runs with one
# leading non-letter, digit runs, punctuation runs, line breaks and other whitespace.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LETTERS = r"[^\r\n\p{L}\p{N}]?\p{L}+"
_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = "|".join([_CONTRACTIONS, _LETTERS, r"\p{N}{1,3}", _REST])
QWEN2_SPLIT = "|".join([_CONTRACTIONS, _LETTERS, r"\p{N}", _REST])
PRE_TOKENIZERS = ("gpt-2", "smollm", "llama-bpe", "qwen2")


def _gpt2_split():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _regex_split(pattern: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _pre_tokenizer(name: str, source: str):
    if name == "gpt-2":
        return _gpt2_split()
    if name == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])
    if name == "llama-bpe":
        return _regex_split(LLAMA3_SPLIT)
    if name == "qwen2":
        return _regex_split(QWEN2_SPLIT)
    raise CheckpointError(f"{source}: tokenizer.ggml.pre {name!r} is not supported; astrai knows "
                          f"{', '.join(PRE_TOKENIZERS)}")


def _token_at(tokens: list[str], meta: GGUFMetadata, key: str) -> str | None:
    if key not in meta:
        return None
    index = meta.need_int(key)
    if not 0 <= index < len(tokens):
        raise CheckpointError(f"{meta.source}: {key} = {index} is outside the vocabulary of {len(tokens)} tokens")
    return tokens[index]


def tokenizer_from_metadata(meta: GGUFMetadata) -> tuple[Tokenizer, dict]:
    """The ``tokenizers`` backend and AutoTokenizer config a GGUF file describes (AutoTokenizer wraps
    them: this module stays below it); CheckpointError naming what is missing or unsupported."""
    kind = meta.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{meta.source}: tokenizer.ggml.model {kind!r} is not supported; astrai imports "
                              "byte-level BPE tokenizers ('gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    split = _pre_tokenizer(pre, meta.source)
    tokens = list(meta.need("tokenizer.ggml.tokens"))
    merges = [tuple(merge.split(" ", 1)) for merge in meta.need("tokenizer.ggml.merges")]
    types = list(meta.get("tokenizer.ggml.token_type", []))
    if types and len(types) != len(tokens):
        raise CheckpointError(f"{meta.source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{meta.source}: tokenizer.ggml.tokens lists a token twice")
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre == "llama-bpe")
    except Exception as exc:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise CheckpointError(f"{meta.source}: tokenizer.ggml.merges do not fit the vocabulary ({exc})") from None
    tokenizer = Tokenizer(bpe)
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    bos = _token_at(tokens, meta, "tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    tokenizer.post_processor = (processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                              special_tokens=[(bos, vocab[bos])])
                                if add_bos else processors.ByteLevel(trim_offsets=False))
    config = {
        "bos_token": bos,
        "eos_token": _token_at(tokens, meta, "tokenizer.ggml.eos_token_id"),
        "pad_token": _token_at(tokens, meta, "tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tokenizer, config


def tokenizer_from_gguf(path: str | os.PathLike) -> tuple[Tokenizer, dict]:
    """The tokenizer stored in a GGUF file as (backend, config) (its metadata only; the weights are not read)."""
    return tokenizer_from_metadata(GGUFMetadata(read_gguf(path), str(path)))
