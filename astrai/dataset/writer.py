"""ShardWriter: appends key arrays and writes a shard whenever enough has gathered.

Shards end on example boundaries (a whole row, a whole document), so every shard
is a valid dataset on its own; meta.json is written last, so a directory without
it is recognisably unfinished.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from astrai.dataset.formats import WRITERS
from astrai.dataset.storage_formats import META_FILE
from astrai.errors import DataError


class ShardWriter:
    def __init__(self, path: str | Path, storage_format: str, shard_size: int, dtypes: dict[str, str]):
        if storage_format not in WRITERS:
            raise DataError(f"unknown storage format {storage_format!r}; choose from {sorted(WRITERS)}")
        if shard_size < 1:
            raise DataError(f"shard_size must be positive, got {shard_size}")
        self.path = Path(path)
        self.format = storage_format
        self.shard_size = shard_size
        self.dtypes = dtypes
        self.shards: list[dict] = []
        self._pending: dict[str, list[np.ndarray]] = {}
        self._pending_len = 0
        self.totals: dict[str, int] = {}
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(f"{self.path}: cannot create the output directory ({exc.strerror})") from None
        stale = self.path / META_FILE
        if stale.exists():
            stale.unlink()

    def add(self, chunk: dict[str, np.ndarray]) -> None:
        for key, array in chunk.items():
            self._pending.setdefault(key, []).append(array)
        self._pending_len += len(next(iter(chunk.values())))
        if self._pending_len >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self._pending_len:
            return
        name = f"{len(self.shards):05d}"
        arrays = {key: np.concatenate(parts).astype(self.dtypes[key], copy=False) for key, parts in self._pending.items()}
        WRITERS[self.format](self.path, name, arrays)
        lengths = {key: int(len(a)) for key, a in arrays.items()}
        for key, n in lengths.items():
            self.totals[key] = self.totals.get(key, 0) + n
        self.shards.append({"name": name, "lengths": lengths})
        self._pending, self._pending_len = {}, 0

    def close(self, meta: dict) -> dict:
        self.flush()
        keys = {key: {"dtype": self.dtypes[key], "length": self.totals[key]} for key in self.totals}
        meta = {"format": self.format, "version": 1, **meta, "keys": keys, "shards": self.shards}
        (self.path / META_FILE).write_text(json.dumps(meta, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        return meta
