"""PrefixCache: find pages already holding a prompt's leading tokens.

Only full pages are shared. A page is keyed by (parent page, its exact tokens), so
two prompts share a page only when every token before and inside it is identical:
the dictionary compares the token tuples themselves, a hash collision cannot cause a
false match. Evicting a page also forgets its descendants, whose keys name it as a
parent and would otherwise dangle (and could match wrongly once the page is reused).
"""

from __future__ import annotations

from typing import Sequence

ROOT = -1


class PrefixCache:
    def __init__(self, page_size: int):
        self._page_size = page_size
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._children: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._key_of)

    def has_page(self, idx: int) -> bool:
        return idx in self._key_of

    def lookup(self, token_ids: Sequence[int], max_pages: int | None = None) -> list[int]:
        """Pages holding the longest cached run of full pages at the start of ``token_ids``."""
        ps = self._page_size
        n = len(token_ids) // ps if max_pages is None else min(max_pages, len(token_ids) // ps)
        pages: list[int] = []
        parent = ROOT
        for i in range(n):
            page = self._index.get((parent, tuple(token_ids[i * ps:(i + 1) * ps])))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def record(self, page_idx: int, page_tokens: Sequence[int], parent_page: int = ROOT) -> bool:
        """Register a full page under its parent; False if that content is already cached elsewhere."""
        if len(page_tokens) != self._page_size:
            raise ValueError(f"only full pages ({self._page_size} tokens) can be recorded, got {len(page_tokens)}")
        if page_idx in self._key_of:
            return False
        if parent_page != ROOT and parent_page not in self._key_of:
            return False
        key = (parent_page, tuple(page_tokens))
        if key in self._index:
            return False
        self._index[key] = page_idx
        self._key_of[page_idx] = key
        if parent_page != ROOT:
            self._children.setdefault(parent_page, set()).add(page_idx)
        return True

    def evict(self, page_idx: int) -> list[int]:
        """Forget ``page_idx`` and all its descendants; returns the descendants forgotten."""
        dropped: list[int] = []
        stack = [page_idx]
        while stack:
            page = stack.pop()
            key = self._key_of.pop(page, None)
            if key is None:
                continue
            del self._index[key]
            parent = key[0]
            if parent in self._children:
                self._children[parent].discard(page)
            stack.extend(self._children.pop(page, ()))
            if page != page_idx:
                dropped.append(page)
        return dropped

    def clear(self) -> list[int]:
        """Forget everything; returns the pages that were registered."""
        pages = list(self._key_of)
        self._index.clear()
        self._key_of.clear()
        self._children.clear()
        return pages
