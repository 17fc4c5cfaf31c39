"""Segment fetchers: many stored pieces (shards) of a stream read as one stream.

Preprocessing writes a key's tokens in shards; training wants ``[begin, end)`` of
the whole stream. A slice inside one shard is a view of that shard (for
memory-mapped files no byte is copied); only a slice that crosses shards is
concatenated.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from astrai.errors import DataError


class BaseSegmentFetcher:
    """One key's segments (1-D arrays) addressed by a global position."""

    def __init__(self, segments: Sequence[np.ndarray]):
        self.segments = [s for s in segments if len(s) > 0]
        self.cum_lengths = np.cumsum([0] + [len(s) for s in self.segments]).tolist()
        self.total_length = self.cum_lengths[-1]

    def __len__(self) -> int:
        return self.total_length

    def fetch_array(self, begin_idx: int, end_idx: int) -> np.ndarray:
        """Elements ``[begin_idx, end_idx)`` as a numpy array (a view when inside one segment)."""
        if not 0 <= begin_idx <= end_idx <= self.total_length:
            raise IndexError(f"range [{begin_idx}, {end_idx}) outside a stream of length {self.total_length}")
        if begin_idx == end_idx:
            dtype = self.segments[0].dtype if self.segments else np.int32
            return np.empty(0, dtype=dtype)
        first = bisect_right(self.cum_lengths, begin_idx) - 1
        pieces = []
        seg = first
        while self.cum_lengths[seg] < end_idx:
            offset = self.cum_lengths[seg]
            pieces.append(self.segments[seg][max(begin_idx - offset, 0): end_idx - offset])
            seg += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def fetch_data(self, begin_idx: int, end_idx: int) -> torch.Tensor:
        return torch.from_numpy(self.fetch_array(begin_idx, end_idx))


class MultiSegmentFetcher:
    """Fetchers for several keys (e.g. tokens and loss masks) of one dataset."""

    def __init__(self, segments_by_key: dict[str, Sequence[np.ndarray]]):
        self.multi_fetchers = {key: BaseSegmentFetcher(segs) for key, segs in segments_by_key.items()}
        self.multi_keys = list(self.multi_fetchers)

    def __len__(self) -> int:
        return len(self.multi_fetchers[self.multi_keys[0]]) if self.multi_keys else 0

    def length(self, key: str) -> int:
        return len(self._fetcher(key))

    def _fetcher(self, key: str) -> BaseSegmentFetcher:
        try:
            return self.multi_fetchers[key]
        except KeyError:
            raise DataError(f"no key {key!r} in this dataset; it has {self.multi_keys}") from None

    def key_fetch(self, begin_idx: int, end_idx: int, keys: str | Iterable[str]) -> dict[str, torch.Tensor]:
        keys = [keys] if isinstance(keys, str) else list(keys)
        return {key: self._fetcher(key).fetch_data(begin_idx, end_idx) for key in keys}

    def fetch_data(self, begin_idx: int, end_idx: int) -> dict[str, torch.Tensor]:
        return self.key_fetch(begin_idx, end_idx, self.multi_keys)
