"""Layouts: how encoded examples become the stored key streams.

- ``StreamLayout`` (packing "concat", seq/sft): documents back to back, any window later.
- ``TokenRowLayout`` (packing "none" or "best_fit", seq/sft): fixed rows of
  ``seq_len + 1`` tokens; "none" puts one document per row, "best_fit" fills rows
  with whole documents by best-fit decreasing, so little is padding and no document
  is cut. Padding has loss mask 0 and a document id of its own.
- ``PairRowLayout`` (dpo) and ``GRPORowLayout`` (grpo): one pair / response per row.

``doc_ids`` are stored when positions reset per document or attention must stay
inside documents; the datasets derive position ids from them.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter

import numpy as np

from astrai.dataset.records import RecordError

KEY_DTYPES = {"sequence": "int32", "loss_mask": "uint8", "doc_ids": "int32", "chosen": "int32",
              "chosen_mask": "uint8", "rejected": "int32", "rejected_mask": "uint8", "prompts": "int32",
              "prompt_mask": "uint8", "responses": "int32", "masks": "uint8", "rewards": "float32"}


def truncate(arrays: tuple[np.ndarray, ...], length: int, side: str) -> tuple[np.ndarray, ...]:
    """Cut parallel arrays to ``length`` keeping the start (side 'right') or the end ('left')."""
    if len(arrays[0]) <= length:
        return arrays
    return tuple(a[:length] if side == "right" else a[len(a) - length:] for a in arrays)


def best_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each item (longest first) goes to the fullest bin it fits in."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin index), sorted
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        pos = bisect_left(free, (lengths[item], -1))
        if pos < len(free):
            remaining, index = free.pop(pos)
        else:
            remaining, index = capacity, len(bins)
            bins.append([])
        bins[index].append(item)
        remaining -= lengths[item]
        if remaining > 0:
            insort(free, (remaining, index))
    return bins


class Layout:
    """Collects examples; ``drain`` hands back {key: array} chunks ready to write."""

    layout = "stream"

    def __init__(self, opts):
        self.opts = opts
        self.stats: Counter = Counter()
        self._chunks: list[dict[str, np.ndarray]] = []
        self.next_doc_id = 0

    @property
    def keys(self) -> list[str]:
        raise NotImplementedError

    def row_lengths(self) -> dict[str, int]:
        return {}

    def add(self, example) -> None:
        raise NotImplementedError

    def drain(self, final: bool = False) -> list[dict[str, np.ndarray]]:
        chunks, self._chunks = self._chunks, []
        return chunks

    def _doc_id(self) -> int:
        self.next_doc_id += 1
        return self.next_doc_id - 1


class StreamLayout(Layout):
    def __init__(self, opts, with_mask: bool):
        super().__init__(opts)
        self.with_mask = with_mask

    @property
    def keys(self):
        return ["sequence"] + (["loss_mask"] if self.with_mask else []) + (["doc_ids"] if self.opts.store_doc_ids else [])

    def add(self, example) -> None:
        ids, mask = example if self.with_mask else (example, None)
        chunk = {"sequence": ids}
        if self.with_mask:
            chunk["loss_mask"] = mask
        if self.opts.store_doc_ids:
            chunk["doc_ids"] = np.full(len(ids), self._doc_id(), dtype=np.int32)
        self.stats["documents"] += 1
        self._chunks.append(chunk)


class TokenRowLayout(Layout):
    layout = "rows"

    def __init__(self, opts, with_mask: bool):
        super().__init__(opts)
        self.with_mask = with_mask
        self.row = opts.seq_len + 1
        self._buffer: list[tuple[np.ndarray, np.ndarray]] = []

    @property
    def keys(self):
        return ["sequence", "loss_mask"] + (["doc_ids"] if self.opts.store_doc_ids else [])

    def row_lengths(self):
        return {key: self.row for key in self.keys}

    def add(self, example) -> None:
        ids, mask = example if self.with_mask else (example, np.ones(len(example), dtype=np.uint8))
        self.stats["documents"] += 1
        if len(ids) > self.row:
            if self.with_mask:
                ids, mask = truncate((ids, mask), self.row, self.opts.truncation)
                self.stats["truncated"] += 1
            else:  # plain text loses nothing: split into row-sized pieces
                for begin in range(0, len(ids), self.row):
                    self._buffer.append((ids[begin:begin + self.row], mask[begin:begin + self.row]))
                self.stats["split"] += 1
                self._maybe_pack()
                return
        self._buffer.append((ids, mask))
        self._maybe_pack()

    def _maybe_pack(self, final: bool = False) -> None:
        if self.opts.packing == "none":
            groups = [[i] for i in range(len(self._buffer))]
        elif final or len(self._buffer) >= self.opts.pack_buffer:
            groups = best_fit_bins([len(ids) for ids, _ in self._buffer], self.row)
        else:
            return
        for group in groups:
            self._chunks.append(self._make_row([self._buffer[i] for i in group]))
        self._buffer = []

    def _make_row(self, docs) -> dict[str, np.ndarray]:
        pad = self.row - sum(len(ids) for ids, _ in docs)
        pieces = list(docs)
        if pad:
            pieces.append((np.full(pad, self.opts.pad_id, dtype=np.int32), np.zeros(pad, dtype=np.uint8)))
            self.stats["padding_tokens"] += pad
        row = {"sequence": np.concatenate([ids for ids, _ in pieces]).astype(np.int32),
               "loss_mask": np.concatenate([m for _, m in pieces]).astype(np.uint8)}
        if self.opts.store_doc_ids:
            row["doc_ids"] = np.concatenate([np.full(len(ids), self._doc_id(), dtype=np.int32) for ids, _ in pieces])
        self.stats["rows"] += 1
        return row

    def drain(self, final: bool = False):
        if final and self._buffer:
            self._maybe_pack(final=True)
        return super().drain(final)


def _pad_right(array: np.ndarray, length: int, value) -> np.ndarray:
    return np.concatenate([array, np.full(length - len(array), value, dtype=array.dtype)])


class PairRowLayout(Layout):
    layout = "rows"

    @property
    def keys(self):
        return ["chosen", "chosen_mask", "rejected", "rejected_mask"]

    def row_lengths(self):
        return {key: self.opts.seq_len for key in self.keys}

    def add(self, example) -> None:
        chosen, chosen_mask, rejected, rejected_mask = example
        row = {}
        for name, ids, mask in (("chosen", chosen, chosen_mask), ("rejected", rejected, rejected_mask)):
            if len(ids) > self.opts.seq_len:
                ids, mask = truncate((ids, mask), self.opts.seq_len, self.opts.truncation)
                self.stats["truncated"] += 1
            if not mask.any():
                self.stats["skipped: response truncated away"] += 1
                return
            row[name] = _pad_right(ids, self.opts.seq_len, self.opts.pad_id)
            row[f"{name}_mask"] = _pad_right(mask, self.opts.seq_len, 0)
        self.stats["pairs"] += 1
        self._chunks.append(row)


class GRPORowLayout(Layout):
    layout = "rows"

    def __init__(self, opts):
        super().__init__(opts)
        self.prompt_len = opts.grpo_prompt_len
        self.response_len = opts.seq_len - self.prompt_len
        self.with_responses: bool | None = None

    @property
    def keys(self):
        base = ["prompts", "prompt_mask"]
        return base + (["responses", "masks", "rewards"] if self.with_responses else [])

    def row_lengths(self):
        widths = {"prompts": self.prompt_len, "prompt_mask": self.prompt_len}
        if self.with_responses:
            widths.update(responses=self.response_len, masks=self.response_len, rewards=1)
        return widths

    def add(self, example) -> None:
        prompt_ids, answers = example
        has_answers = bool(answers)
        if self.with_responses is None:
            self.with_responses = has_answers
        elif self.with_responses != has_answers:
            raise RecordError("mixed records", "some GRPO records have responses and rewards and others do not; "
                             "use one kind per dataset (scored responses for offline, prompts alone for online)")
        if len(prompt_ids) > self.prompt_len:
            prompt_ids = prompt_ids[len(prompt_ids) - self.prompt_len:]  # keep the end, next to the answer
            self.stats["prompts_truncated"] += 1
        pad = self.prompt_len - len(prompt_ids)
        prompt = np.concatenate([np.full(pad, self.opts.pad_id, dtype=np.int32), prompt_ids])
        prompt_mask = np.concatenate([np.zeros(pad, np.uint8), np.ones(len(prompt_ids), np.uint8)])
        self.stats["prompts"] += 1
        if not has_answers:
            self._chunks.append({"prompts": prompt, "prompt_mask": prompt_mask})
            return
        for ids, mask, reward in answers:
            if len(ids) > self.response_len:
                ids, mask = ids[: self.response_len], mask[: self.response_len]
                self.stats["truncated"] += 1
            self._chunks.append({"prompts": prompt, "prompt_mask": prompt_mask,
                                 "responses": _pad_right(ids, self.response_len, self.opts.pad_id),
                                 "masks": _pad_right(mask, self.response_len, 0),
                                 "rewards": np.array([reward], dtype=np.float32)})
            self.stats["responses"] += 1


def make_layout(opts) -> Layout:
    if opts.train_type in ("seq", "sft"):
        with_mask = opts.train_type == "sft"
        return StreamLayout(opts, with_mask) if opts.packing == "concat" else TokenRowLayout(opts, with_mask)
    if opts.train_type == "dpo":
        return PairRowLayout(opts)
    return GRPORowLayout(opts)
