"""Datasets: the windows and rows a training step reads from storage.

SEQ and SFT data is either one long stream (documents back to back; any window
size and stride) or fixed rows (documents padded or best-fit packed at
preprocessing; the window is the row). DPO and GRPO data is always rows, one
pair or one response per row. Items are dicts of tensors whose keys are fixed by
CONTRACTS.md, so the trainer's strategies read them by name.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from astrai.dataset.storage_formats import BaseStorage, create_storage, detect_format
from astrai.errors import DataError
from astrai.factory import BaseFactory

IGNORE_INDEX = -100


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document, counting from the window start for the
    document already under way (so positions never exceed the window)."""
    index = torch.arange(len(doc_ids))
    starts = torch.ones(len(doc_ids), dtype=torch.bool)
    starts[1:] = doc_ids[1:] != doc_ids[:-1]
    last_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=0).values
    return index - last_start


class BaseDataset(Dataset):
    """A view of a loaded storage; subclasses say which keys they need and how to cut items."""

    required_keys: tuple[str, ...] = ()
    train_type = "base"

    def __init__(self, window_size: int | None = None, stride: int | None = None):
        if window_size is not None and window_size < 1:
            raise DataError(f"window_size must be a positive number of tokens, got {window_size}")
        if stride is not None and stride < 1:
            raise DataError(f"stride must be a positive number of tokens, got {stride}")
        self.window_size = window_size
        self.stride = stride
        self.storage: BaseStorage | None = None
        self.path: Path | None = None

    def load(self, load_path: str | Path, storage_type: str | None = None, tokenizer=None) -> "BaseDataset":
        self.path = Path(load_path)
        storage_type = storage_type or detect_format(self.path)
        self.storage = create_storage(storage_type).load(self.path, tokenizer)
        missing = [k for k in self.required_keys if k not in self.storage.keys]
        if missing:
            made_as = self.meta.get("train_type", "unknown")
            raise DataError(f"{self.path}: {self.train_type} data needs keys {list(self.required_keys)} but "
                            f"{missing} are missing (stored keys {self.storage.keys}, preprocessed as {made_as!r}); "
                            f"run `astrai preprocess --train_type {self.train_type}`")
        self._setup()
        return self

    @property
    def meta(self) -> dict:
        return self.storage.meta if self.storage is not None else {}

    def row_length(self, key: str) -> int | None:
        """Width of a fixed row of ``key`` when the data was stored as rows, else None."""
        if self.meta.get("layout") != "rows":
            return None
        widths = self.meta.get("row_lengths") or {}
        if key not in widths:
            raise DataError(f"{self.path}: meta.json says layout 'rows' but gives no row length for '{key}'")
        return int(widths[key])

    def _setup(self) -> None:
        """Compute the number of items once the storage is open."""

    def __len__(self) -> int:
        return self._length

    def _check_index(self, index: int) -> int:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        return index


class _TokenWindowDataset(BaseDataset):
    """Next-token windows: ``window_size + 1`` tokens give inputs and shifted targets."""

    required_keys = ("sequence",)

    def _setup(self) -> None:
        total = self.storage.length("sequence")
        row = self.row_length("sequence")
        if row is not None:
            if self.window_size is None:
                self.window_size = row - 1
            if self.window_size != row - 1:
                raise DataError(f"{self.path}: rows were packed for window {row - 1} (`--seq_len` at preprocessing); "
                                f"use window_size {row - 1} or preprocess again")
            self.stride = row
        elif self.window_size is None:
            raise DataError(f"{self.path}: stream data needs a window_size")
        self.stride = self.stride or self.window_size
        span = self.window_size + 1
        self._length = 0 if total < span else (total - span) // self.stride + 1

    def _window(self, index: int) -> dict[str, torch.Tensor]:
        begin = self._check_index(index) * self.stride
        return self.storage.fetch(begin, begin + self.window_size + 1)

    def _common(self, window: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens = window["sequence"].long()
        item = {"input_ids": tokens[:-1], "target_ids": tokens[1:]}
        if "doc_ids" in window:
            doc_ids = window["doc_ids"][:-1].long()
            if self.meta.get("position_ids", "reset") == "reset":
                item["position_ids"] = positions_from_doc_ids(doc_ids)
            if self.meta.get("doc_mask", True):
                item["doc_ids"] = doc_ids
        return item


class SEQDataset(_TokenWindowDataset):
    """Pre-training windows: ``input_ids``, ``target_ids`` (+ ``position_ids``/``doc_ids`` when stored).

    Padding added by row packing is excluded from the loss by target id -100.
    """

    train_type = "seq"

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self._window(index)
        item = self._common(window)
        if "loss_mask" in window:
            item["target_ids"] = item["target_ids"].masked_fill(window["loss_mask"][1:] == 0, IGNORE_INDEX)
        return item


class SFTDataset(_TokenWindowDataset):
    """Fine-tuning windows: as SEQ plus ``loss_mask`` (1 where the target is an assistant token)."""

    required_keys = ("sequence", "loss_mask")
    train_type = "sft"

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self._window(index)
        item = self._common(window)
        item["loss_mask"] = window["loss_mask"][1:].long()
        return item


class _RowDataset(BaseDataset):
    """One stored row per item; row widths were fixed at preprocessing."""

    row_keys: tuple[str, ...] = ()

    def _setup(self) -> None:
        if self.meta.get("layout") != "rows":
            raise DataError(f"{self.path}: {self.train_type} data must be stored as rows (made by "
                            f"`astrai preprocess --train_type {self.train_type}`)")
        self._widths = {key: self.row_length(key) for key in self.row_keys if key in self.storage.keys}
        counts = {key: self.storage.length(key) // width for key, width in self._widths.items()}
        if len(set(counts.values())) != 1:
            raise DataError(f"{self.path}: keys hold different numbers of rows {counts}; the data is damaged")
        self._length = next(iter(counts.values()))
        longest = max(self._widths.values())
        if self.window_size is not None and self.window_size < longest:
            raise DataError(f"{self.path}: rows are {longest} tokens wide but window_size is {self.window_size}; "
                            f"preprocess with --seq_len {self.window_size} or train with window_size {longest}")

    def _row(self, index: int) -> dict[str, torch.Tensor]:
        index = self._check_index(index)
        return {key: self.storage.fetch(index * width, (index + 1) * width, [key])[key]
                for key, width in self._widths.items()}


class DPODataset(_RowDataset):
    """Preference pairs: ``chosen``, ``rejected`` (prompt + response ids, right-padded) and
    ``chosen_mask``/``rejected_mask`` (1 on response tokens)."""

    required_keys = row_keys = ("chosen", "chosen_mask", "rejected", "rejected_mask")
    train_type = "dpo"

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value.long() for key, value in self._row(index).items()}


class GRPODataset(_RowDataset):
    """Scored responses: ``prompts`` (left-padded) + ``prompt_mask``, ``responses`` (right-padded),
    ``masks`` (1 on response tokens) and float ``rewards``. Prompt-only data (for online
    rollouts) has just ``prompts`` and ``prompt_mask``."""

    required_keys = ("prompts", "prompt_mask")
    row_keys = ("prompts", "prompt_mask", "responses", "masks", "rewards")
    train_type = "grpo"

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self._row(index)
        item = {key: value.long() for key, value in row.items() if key != "rewards"}
        if "rewards" in row:
            item["rewards"] = row["rewards"][0].float()
        return item


class DatasetFactory(BaseFactory[BaseDataset]):
    """train type → dataset class; ``load`` opens a preprocessed directory."""

    kind = "dataset"

    @classmethod
    def create(cls, train_type: str, window_size: int | None = None, stride: int | None = None) -> BaseDataset:
        return cls.get(train_type)(window_size, stride)

    @classmethod
    def load(cls, train_type: str, load_path: str | Path, window_size: int | None = None,
             stride: int | None = None) -> BaseDataset:
        return cls.create(train_type, window_size, stride).load(load_path)


for _name, _cls in (("seq", SEQDataset), ("sft", SFTDataset), ("dpo", DPODataset), ("grpo", GRPODataset)):
    DatasetFactory.register(_name)(_cls)
