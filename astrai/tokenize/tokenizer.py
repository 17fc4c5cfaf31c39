"""AutoTokenizer: astrai's tokenizer, a thin layer over Hugging Face ``tokenizers``.

On disk it is exactly what transformers expects (``tokenizer.json`` plus
``tokenizer_config.json`` with the special tokens and the chat template), so a
model directory written by astrai opens with ``PreTrainedTokenizerFast``, and a
plain Hugging Face ``tokenizer.json`` opens here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders

from astrai.errors import CheckpointError, DataError
from astrai.gguf_file import is_gguf
from astrai.tokenize.chat_template import ChatTemplate, default_template
from astrai.tokenize.stream import StreamDecoder
from astrai.tokenize.training import SPECIAL_TOKENS, train_tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
END_OF_TURN = "<|im_end|>"


def _byte_level_alphabet() -> dict[str, int]:
    """Character → byte of the byte-level BPE alphabet (GPT-2's): printable Latin-1 bytes stand for
    themselves, the other bytes (controls, space, a few more) for the code points from 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class AutoTokenizer:
    """Encode/decode text, render chats, stream-detokenise; save and load HF-shaped."""

    def __init__(self, tokenizer: Tokenizer, config: dict | None = None):
        self._tokenizer = tokenizer
        self.config = dict(config or {})
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        template = self.config.get("chat_template")
        if isinstance(template, list):  # HF allows several named templates
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.set_chat_template(template if isinstance(template, str) else default_template())

    # ----- construction -------------------------------------------------------------
    @classmethod
    def train(cls, sources, vocab_size: int, special_tokens: list[str] | None = None,
              show_progress: bool = True, min_frequency: int = 2) -> "AutoTokenizer":
        """Train a byte-level BPE tokenizer on a path or a list of paths (.txt/.jsonl), or on texts:
        a list of strings or any iterator of them."""
        specials = list(special_tokens) if special_tokens is not None else list(SPECIAL_TOKENS)
        tokenizer = train_tokenizer(sources, vocab_size, specials, show_progress, min_frequency)
        config = {
            "bos_token": "<|bos|>" if "<|bos|>" in specials else None,
            "eos_token": "<|eos|>" if "<|eos|>" in specials else None,
            "pad_token": "<|pad|>" if "<|pad|>" in specials else None,
            "extra_special_tokens": [t for t in specials if t not in ("<|bos|>", "<|eos|>", "<|pad|>")],
            "chat_template": default_template(),
        }
        return cls(tokenizer, config)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "AutoTokenizer":
        """Load a directory holding tokenizer.json (+ optional tokenizer_config.json), a tokenizer.json file,
        or the tokenizer in a GGUF file's metadata."""
        if is_gguf(path):
            from astrai.tokenize.gguf_vocab import tokenizer_from_gguf  # defers the GGUF reader (and torch) to GGUF files

            return cls(*tokenizer_from_gguf(path))
        path = Path(path)
        tokenizer_file = path if path.is_file() else path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{path}: no {TOKENIZER_FILE} found (train one with `astrai tokenizer train`)")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{tokenizer_file}: not a valid tokenizers file ({exc})") from None
        config_file = tokenizer_file.parent / CONFIG_FILE
        config = {}
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{config_file}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        template_file = tokenizer_file.parent / TEMPLATE_FILE  # where newer transformers versions save it
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text(encoding="utf-8")
        return cls(tokenizer, config)

    load = from_pretrained

    def save_pretrained(self, save_path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (readable by transformers)."""
        save_path = Path(save_path)
        save_path.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(save_path / TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "model_max_length": self.config.get("model_max_length", 1_000_000_000),
            **{k: v for k, v in self.config.items() if k not in ("tokenizer_class", "chat_template")},
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "chat_template": self.chat_template.template_str,
        }
        (save_path / CONFIG_FILE).write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    # ----- vocabulary ---------------------------------------------------------------
    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. A byte-level token may hold part of a UTF-8 character
        (a CJK character is often two tokens), which ``decode([id])`` can only show as U+FFFD."""
        token = self._tokenizer.id_to_token(int(token_id))
        if token is None:
            raise DataError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)
        if byte_level and int(token_id) not in self.special_ids and all(c in _BYTE_OF_CHAR for c in token):
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        pad = self._id_of(self.pad_token)
        return pad if pad is not None else self.eos_id

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end generation: eos and the end-of-turn marker."""
        ids = [self.eos_id, self._id_of(END_OF_TURN)]
        return sorted({i for i in ids if i is not None})

    @property
    def special_ids(self) -> set[int]:
        return {i for t in self._tokenizer.get_added_tokens_decoder().values() if t.special
                for i in [self._tokenizer.token_to_id(t.content)] if i is not None}

    # ----- encode / decode ----------------------------------------------------------
    def encode(self, text: str | list[str], add_special_tokens: bool = False) -> list[int] | list[list[int]]:
        """Token ids of ``text`` (a string) or of each string in a list (batched, in parallel)."""
        if isinstance(text, str):
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if isinstance(text, (list, tuple)):
            if not all(isinstance(t, str) for t in text):
                raise DataError("encode: every item of a batch must be a string")
            return [e.ids for e in self._encode_batch(list(text), add_special_tokens=add_special_tokens)]
        raise DataError(f"encode: expected a string or a list of strings, got {type(text).__name__}")

    def _encode_batch(self, texts: list[str], add_special_tokens: bool):
        """Batch encoding without character offsets where the library offers it (tokenizers >= 0.20)."""
        fast = getattr(self._tokenizer, "encode_batch_fast", None) or self._tokenizer.encode_batch
        return fast(texts, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return self._tokenizer.decode_batch([list(map(int, ids)) for ids in batch], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """An incremental decoder whose pieces concatenate to ``decode(ids)``."""
        return StreamDecoder(lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens))

    # ----- chat ---------------------------------------------------------------------
    def set_chat_template(self, template: str | ChatTemplate) -> None:
        if isinstance(template, ChatTemplate):
            template = template.template_str
        specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                    "pad_token": self.pad_token or ""}
        self.chat_template = ChatTemplate(template, specials)

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = False,
                            tools: list | None = None, return_assistant_tokens_mask: bool = False, **kwargs):
        """Render a conversation with the chat template (the transformers convention).

        ``tokenize=True`` returns ids; with ``return_assistant_tokens_mask=True`` a dict
        ``{"input_ids", "assistant_masks"}`` where the mask is 1 on tokens the
        assistant produced (its content and end-of-turn marker), for SFT.
        """
        if return_assistant_tokens_mask:
            ids, mask = self.encode_chat(messages, tools=tools, **kwargs)
            return {"input_ids": ids, "assistant_masks": mask}
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text) if tokenize else text

    def encode_chat(self, messages, **kwargs) -> tuple[list[int], list[int]]:
        """Ids of a rendered conversation and a 0/1 mask over assistant tokens."""
        text, spans = self.chat_spans(messages, **kwargs)
        return self.encode_spans([text], [spans])[0]

    def chat_spans(self, messages, **kwargs) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans the assistant produced.

        Each span ends after the turn's last stop token, so the newline the template
        writes after ``<|im_end|>`` (never generated) is not trained on.
        """
        text, spans = self.chat_template.assistant_spans(messages, **kwargs)
        return text, [(begin, self.end_of_response(text, begin, end)) for begin, end in spans]

    def end_of_response(self, text: str, begin: int, end: int) -> int:
        """End of ``text[begin:end]`` cut after its last stop token (``end`` if it has none)."""
        stops = [t for t in (END_OF_TURN, self.eos_token) if t]
        found = [text.rfind(s, begin, end) + len(s) for s in stops if text.rfind(s, begin, end) >= 0]
        return max(found, default=end)

    def encode_spans(self, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[tuple[list[int], list[int]]]:
        """Encode texts with a 0/1 mask that is 1 on the tokens of the given character spans.

        Each text is cut at its span boundaries and the pieces are encoded separately
        (in one batch): no token straddles a boundary, and an answer is tokenised
        exactly as a model generating it after the prompt would produce it.
        """
        pieces, flags, owners = [], [], []
        for owner, (text, text_spans) in enumerate(zip(texts, spans)):
            position = 0
            for begin, end in sorted(text_spans):
                for piece, flag in ((text[position:begin], 0), (text[begin:end], 1)):
                    if piece:
                        pieces.append(piece), flags.append(flag), owners.append(owner)
                position = max(position, end)
            if position < len(text):
                pieces.append(text[position:]), flags.append(0), owners.append(owner)
        out = [([], []) for _ in texts]
        for encoding, flag, owner in zip(self._encode_batch(pieces, add_special_tokens=False),
                                         flags, owners):
            out[owner][0].extend(encoding.ids)
            out[owner][1].extend([flag] * len(encoding.ids))
        return out

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"AutoTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"
