"""PagePool: the allocator and the prefix cache kept consistent with each other.

Freed pages that hold registered prefix content go to the allocator's LRU instead of
the free stack; when the allocator evicts one, its descendants in the prefix tree
are forgotten too and, if nobody uses them, become free at once.
"""

from __future__ import annotations

from typing import Optional, Sequence

from astrai.inference.cache.allocator import Allocator
from astrai.inference.cache.prefix_cache import ROOT, PrefixCache


class PagePool:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = True):
        self.num_pages, self.page_size = num_pages, page_size
        self._alloc = Allocator(num_pages)
        self._prefix = PrefixCache(page_size) if prefix_cache else None
        self._alloc.on_evict = self._forget

    @property
    def allocator(self) -> Allocator:
        return self._alloc

    @property
    def prefix_enabled(self) -> bool:
        return self._prefix is not None

    def _forget(self, page: int) -> None:
        for child in self._prefix.evict(page):
            self._alloc.uncache(child)

    def alloc(self) -> Optional[int]:
        return self._alloc.alloc()

    def free(self, idx: int) -> None:
        keep = self._prefix is not None and self._prefix.has_page(idx)
        self._alloc.free(idx, keep_cached=keep)

    def inc_ref(self, idx: int) -> None:
        self._alloc.inc_ref(idx)
        self._alloc.touch(idx)

    def lookup(self, token_ids: Sequence[int], max_pages: int | None = None) -> list[int]:
        if self._prefix is None:
            return []
        return self._prefix.lookup(token_ids, max_pages)

    def record(self, page_idx: int, page_tokens: Sequence[int], parent_page: int = ROOT) -> bool:
        if self._prefix is None:
            return False
        return self._prefix.record(page_idx, page_tokens, parent_page)

    def clear_prefix(self) -> None:
        """Forget all cached content (e.g. after new weights): cached pages become free."""
        if self._prefix is None:
            return
        for page in self._prefix.clear():
            self._alloc.uncache(page)

    def stats(self) -> dict[str, int]:
        a = self._alloc
        return {"pages_total": self.num_pages, "pages_used": a.num_used, "pages_free": a.num_free,
                "pages_cached": a.num_cached}
