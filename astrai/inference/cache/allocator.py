"""Allocator: O(1) page allocation with reference counts and an LRU of cached pages.

A page is in exactly one of three states: free (on the free stack), used (ref > 0)
or cached (ref == 0 but its content is still registered in the prefix cache, kept in
an LRU). ``alloc`` prefers free pages and evicts the least recently used cached page
only when nothing is free; the owner (PagePool) is told about the eviction through
``on_evict`` so the prefix index forgets it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional


class Allocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: list[int] = [0] * num_pages
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.on_evict: Optional[Callable[[int], None]] = None

    # --- counts -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free) - len(self._lru)

    @property
    def num_available(self) -> int:
        """Pages ``alloc`` can hand out right now (free ones plus evictable cached ones)."""
        return len(self._free) + len(self._lru)

    # --- operations -----------------------------------------------------------
    def alloc(self) -> Optional[int]:
        """A page with ref 1, or None when every page is in use."""
        if self._free:
            idx = self._free.pop()
        elif self._lru:
            idx, _ = self._lru.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(idx)
        else:
            return None
        self._refs[idx] = 1
        return idx

    def free(self, idx: int, keep_cached: bool = False) -> None:
        """Drop one reference; at zero the page becomes cached (if asked) or free."""
        refs = self._refs[idx]
        if refs <= 0:
            raise RuntimeError(f"page {idx} freed more often than allocated")
        self._refs[idx] = refs - 1
        if refs == 1:
            if keep_cached:
                self._lru[idx] = None
            else:
                self._free.append(idx)

    def inc_ref(self, idx: int) -> None:
        """Take another reference; a cached page returns to use."""
        if self._refs[idx] == 0:
            if idx not in self._lru:
                raise RuntimeError(f"page {idx} is free; only used or cached pages can be shared")
            del self._lru[idx]
        self._refs[idx] += 1

    def touch(self, idx: int) -> None:
        """Mark a cached page as recently used."""
        if idx in self._lru:
            self._lru.move_to_end(idx)

    def uncache(self, idx: int) -> None:
        """A cached page lost its prefix entry: it becomes plainly free."""
        if idx in self._lru:
            del self._lru[idx]
            self._free.append(idx)

    def ref_count(self, idx: int) -> int:
        return self._refs[idx]

    def is_cached(self, idx: int) -> bool:
        return idx in self._lru
