"""Raw JSONL records → token arrays, one function per train type.

Accepted records (one JSON object per line):
- seq:  {"text": str}
- sft:  {"messages": [{"role", "content"}, ...]}  or  {"prompt": str, "response": str}
- dpo:  {"prompt": str | messages, "chosen": str, "rejected": str}
- grpo: {"prompt": str | messages, "responses": [str], "rewards": [float]}
        or {"prompt", "response": str, "reward": float}, or {"prompt"} alone (for online rollouts)
A ``messages`` prompt is rendered with the chat template (with the generation
prompt) and its answers end with the end-of-turn token; a plain-string prompt is
used as is and its answers end with eos. Problems raise ``RecordError`` with the
field at fault; the caller adds the file and line.
"""

from __future__ import annotations

import json
import math

import numpy as np

from astrai.tokenize.chat_template import validate_messages
from astrai.errors import DataError


class RecordError(ValueError):
    """A record is unusable; ``reason`` is a short category for the summary."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_line(line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RecordError("invalid JSON", f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise RecordError("not an object", f"expected a JSON object, got {type(record).__name__}")
    return record


def _field(record: dict, key: str, kinds: type | tuple, kind_name: str):
    if key not in record:
        raise RecordError("missing field", f"missing field '{key}'")
    value = record[key]
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise RecordError("wrong type", f"field '{key}' must be {kind_name}, got {type(value).__name__}")
    return value


def _messages(value, key: str) -> list[dict]:
    try:
        return validate_messages(value)
    except DataError as exc:
        raise RecordError("wrong type", f"field '{key}': {exc}") from None


def _answer(record: dict, key: str) -> str:
    """An answer given as a string or as one assistant message (the TRL convention)."""
    if key not in record:
        raise RecordError("missing field", f"missing field '{key}'")
    value = record[key]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        value = value[0].get("content")
    if not isinstance(value, str):
        raise RecordError("wrong type", f"field '{key}' must be a string (or one assistant message), "
                                        f"got {type(record[key]).__name__}")
    return value


class RecordEncoder:
    """Turns parsed records into token arrays with one tokenizer (one per worker process)."""

    def __init__(self, tokenizer, train_type: str):
        self.tokenizer = tokenizer
        self.train_type = train_type
        if tokenizer.eos_id is None:
            raise DataError("the tokenizer has no eos token; documents need one to be separated")
        self.eos_id = tokenizer.eos_id

    # Each prepare_* returns the pieces to encode (texts for seq, (text, spans) otherwise)
    # and a function building the example from their encodings, so that a whole batch
    # of records is encoded in one call to the tokenizer.
    def prepare(self, record: dict):
        return getattr(self, f"_prepare_{self.train_type}")(record)

    def encode_pieces(self, pieces: list) -> list:
        if self.train_type == "seq":
            return self.tokenizer.encode(pieces)
        return self.tokenizer.encode_spans([p[0] for p in pieces], [p[1] for p in pieces])

    def _prepare_seq(self, record):
        text = _field(record, "text", str, "a string")
        return [text], lambda encoded: np.array(encoded[0] + [self.eos_id], dtype=np.int32)

    def _prepare_sft(self, record):
        if "messages" in record or "prompt" not in record:
            messages = _messages(_field(record, "messages", list, "a list of messages"), "messages")
        else:
            prompt = _field(record, "prompt", str, "a string")
            response = _field(record, "response", str, "a string")
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        if not any(m["role"] == "assistant" for m in messages):
            raise RecordError("no assistant turn", "conversation has no assistant message to learn from")
        text, spans = self.tokenizer.chat_spans(messages)

        def build(encoded):
            ids, mask = encoded[0]
            return np.array(ids, dtype=np.int32), np.array(mask, dtype=np.uint8)
        return [(text, spans)], build

    def _prompt_text(self, record) -> tuple[str, list | None]:
        if "prompt" not in record:
            raise RecordError("missing field", "missing field 'prompt'")
        prompt = record["prompt"]
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, list):
            messages = _messages(prompt, "prompt")
            return self.tokenizer.chat_template.render(messages, add_generation_prompt=True), messages
        raise RecordError("wrong type", f"field 'prompt' must be a string or a list of messages, "
                                        f"got {type(prompt).__name__}")

    def _with_answer(self, prompt_text: str, messages, answer: str) -> tuple[str, list[tuple[int, int]]]:
        """Prompt + answer text and the answer's character span (ending at its stop token)."""
        if messages is None:
            text = prompt_text + answer + (self.tokenizer.eos_token or "")
            return text, [(len(prompt_text), len(text))]
        text = self.tokenizer.chat_template.render(messages + [{"role": "assistant", "content": answer}])
        if not text.startswith(prompt_text):
            raise RecordError("template", "the chat template renders the prompt differently once an answer "
                                          "follows, so the answer cannot be located")
        end = self.tokenizer.end_of_response(text, len(prompt_text), len(text))
        return text[:end], [(len(prompt_text), end)]  # what follows the stop token is never generated

    def _prepare_dpo(self, record):
        prompt_text, messages = self._prompt_text(record)
        pieces = [self._with_answer(prompt_text, messages, _answer(record, k)) for k in ("chosen", "rejected")]

        def build(encoded):
            return tuple(np.array(x, dtype=np.int32 if j == 0 else np.uint8)
                         for ids_mask in encoded for j, x in enumerate(ids_mask))
        return pieces, build

    def _prepare_grpo(self, record):
        prompt_text, messages = self._prompt_text(record)
        if "responses" in record or "response" in record:
            if "responses" in record:
                responses = _field(record, "responses", list, "a list of strings")
                rewards = _field(record, "rewards", list, "a list of numbers")
            else:
                responses = [_field(record, "response", str, "a string")]
                rewards = [_field(record, "reward", (int, float), "a number")]
            if len(responses) != len(rewards) or not responses:
                raise RecordError("mismatch", f"'responses' ({len(responses)}) and 'rewards' ({len(rewards)}) "
                                              f"must be non-empty lists of the same length")
            for i, (response, reward) in enumerate(zip(responses, rewards)):
                if not isinstance(response, str):
                    raise RecordError("wrong type", f"responses[{i}] must be a string, got {type(response).__name__}")
                if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                    raise RecordError("wrong type", f"rewards[{i}] must be a finite number, got {reward!r}")
        else:
            responses, rewards = [], []
        pieces = [(prompt_text, [])] + [self._with_answer(prompt_text, messages, r) for r in responses]

        def build(encoded):
            prompt_ids = np.array(encoded[0][0], dtype=np.int32)
            answers = []
            for (ids, mask), reward in zip(encoded[1:], rewards):
                ids, mask = np.array(ids, dtype=np.int32), np.array(mask, dtype=np.uint8)
                start = int(np.argmax(mask)) if mask.any() else len(ids)
                answers.append((ids[start:], mask[start:], float(reward)))
            return prompt_ids, answers
        return pieces, build
