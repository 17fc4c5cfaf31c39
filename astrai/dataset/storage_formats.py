"""Storage: named token streams on disk behind one interface, whatever the format.

A preprocessed dataset directory holds ``meta.json`` (format, keys and their
dtypes, shard list, how it was made) and one file per shard per format:
``{key}.{shard}.bin`` for memory-mapped raw arrays, ``shard-{shard}.h5`` for HDF5,
``shard-{shard}.json`` for JSON. Every format loads into a ``MultiSegmentFetcher``,
so datasets read ``fetch(begin, end, keys)`` and never care which format it was.
HDF5 and JSON files written by other tools (one object of key → list of numbers,
or JSONL lines of such objects) load too, without meta.json.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from astrai.dataset.fetcher import MultiSegmentFetcher
from astrai.errors import DataError
from astrai.factory import Registry

META_FILE = "meta.json"
_STORAGE_REGISTRY = Registry("storage format")
SUFFIXES = {".bin": "mmap", ".h5": "h5", ".hdf5": "h5", ".json": "json", ".jsonl": "json"}


def register_storage(name: str):
    def decorator(cls):
        _STORAGE_REGISTRY.register(name, cls, category="storage")
        cls.format_name = name
        return cls
    return decorator


def read_meta(path: Path) -> dict:
    meta_path = path / META_FILE
    if not meta_path.is_file():
        return {}
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{meta_path}: cannot be read as JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path}: expected a JSON object")
    return meta


def detect_format(path: str | Path) -> str:
    """'mmap', 'h5' or 'json' for a dataset directory (by meta.json, else by its files) or a file."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such dataset file or directory")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise DataError(f"{path}: cannot be read (permission denied)")
    if path.is_file():
        if path.suffix in SUFFIXES and SUFFIXES[path.suffix] != "mmap":
            return SUFFIXES[path.suffix]
        raise DataError(f"{path}: unknown storage file type {path.suffix!r}; expected .h5, .json or .jsonl "
                        f"(memory-mapped .bin data is loaded through its directory's meta.json)")
    meta = read_meta(path)
    if "format" in meta:
        if meta["format"] not in _STORAGE_REGISTRY:
            raise DataError(f"{path / META_FILE}: unknown format {meta['format']!r}; "
                            f"known: {', '.join(_STORAGE_REGISTRY.list_names())}")
        return meta["format"]
    found = {SUFFIXES[p.suffix] for p in path.iterdir() if p.suffix in SUFFIXES}
    if found == {"h5"} or found == {"json"}:
        return found.pop()
    if not found:
        raise DataError(f"{path}: no dataset here (no meta.json, .h5, .json or .jsonl files); "
                        f"create one with `astrai preprocess`")
    raise DataError(f"{path}: mixed storage files {sorted(found)} and no meta.json saying which to use")


def create_storage(storage_type: str) -> "BaseStorage":
    """A storage object for a format name ('mmap', 'h5', 'json')."""
    return _STORAGE_REGISTRY.get(storage_type)()


def shard_names(meta: dict, path: Path) -> list[str]:
    shards = meta.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and "name" in s for s in shards):
        raise DataError(f"{path / META_FILE}: 'shards' must be a list of {{'name': ...}} objects")
    return [s["name"] for s in shards]


class BaseStorage(ABC):
    """Named, aligned token streams (``keys``) read by range."""

    format_name = "base"

    def __init__(self):
        self._fetcher: MultiSegmentFetcher | None = None
        self.meta: dict = {}
        self.path: Path | None = None

    def load(self, load_path: str | Path, tokenizer=None) -> "BaseStorage":
        """Open ``load_path``; ``tokenizer`` is accepted for interface compatibility and unused
        (data is stored already tokenised)."""
        self.path = Path(load_path)
        if not self.path.exists():
            raise DataError(f"{self.path}: no such dataset file or directory")
        self.meta = read_meta(self.path) if self.path.is_dir() else {}
        segments = self._load_segments(self.path)
        self._check_shard_lengths(segments)
        if not segments or all(len(s) == 0 for segs in segments.values() for s in segs):
            raise DataError(f"{self.path}: the dataset is empty (no tokens stored)")
        self._fetcher = MultiSegmentFetcher(segments)
        return self

    @abstractmethod
    def _load_segments(self, path: Path) -> dict[str, list[np.ndarray]]:
        """key → its shards, in order."""

    def shard_file(self, key: str, shard: str) -> Path:
        """The file that holds ``key`` of ``shard`` (named in errors)."""
        return self.path / f"shard-{shard}.{self.format_name}"

    def _check_shard_lengths(self, segments: dict[str, list[np.ndarray]]) -> None:
        """A shard shorter or longer than meta.json records (a truncated copy, a file from another
        run) would otherwise be trained on silently, or shift every row after it."""
        shards = self.meta.get("shards")
        if not isinstance(shards, list):
            return
        for i, shard in enumerate(shards):
            lengths = shard.get("lengths") if isinstance(shard, dict) else None
            if not isinstance(lengths, dict):
                continue
            for key, expected in lengths.items():
                if key not in segments or i >= len(segments[key]):
                    continue
                found, itemsize = len(segments[key][i]), segments[key][i].dtype.itemsize
                if found != expected:
                    raise DataError(f"{self.shard_file(key, shard['name'])}: holds {found} tokens "
                                    f"({found * itemsize} bytes) but {META_FILE} records {expected} "
                                    f"({expected * itemsize} bytes); the file is truncated or from another run: "
                                    "copy it again or re-run `astrai preprocess`")

    @property
    def fetcher(self) -> MultiSegmentFetcher:
        if self._fetcher is None:
            raise DataError("storage used before load(path)")
        return self._fetcher

    @property
    def keys(self) -> list[str]:
        return list(self.fetcher.multi_keys)

    def length(self, key: str) -> int:
        return self.fetcher.length(key)

    def fetch(self, begin: int, end: int, keys: str | Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        return self.fetcher.key_fetch(begin, end, self.keys if keys is None else keys)

    def __len__(self) -> int:
        return len(self.fetcher)

    def __repr__(self) -> str:
        lengths = {k: self.length(k) for k in self.keys} if self._fetcher else {}
        return f"{type(self).__name__}({self.path}, {lengths})"
