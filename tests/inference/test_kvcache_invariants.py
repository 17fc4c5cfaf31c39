"""The paged cache under random operation sequences (hypothesis).

Every token's cached "K" is the token id itself, so reading a task's context back
through a bound view shows whether page tables, prefix reuse and padding are right.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from astrai.inference.cache import KVCache

PAGE, PAGES = 2, 12

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)
op_st = st.one_of(
    st.tuples(st.just("alloc"), tokens_st),
    st.tuples(st.just("grow"), st.lists(st.integers(0, 3), min_size=1, max_size=4)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("fork"), tokens_st),  # alloc with the task sharing most of its tokens as donor
)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _compute(cache: KVCache, tasks: dict, computed: dict, ids: list[str]) -> None:
    """Write every task's uncomputed tokens in one multi-row view and read the contexts back
    (tokens a task took from the prefix cache or copied from a donor included)."""
    if not ids:
        return
    starts = [computed[t] for t in ids]
    n_new = [len(tasks[t]) - s for t, s in zip(ids, starts)]
    view = cache.bind(cache.make_table_tensor(ids), starts, n_new)
    T = max(n_new)
    values = torch.tensor([tasks[t][s:] + [-1] * (T - n) for t, s, n in zip(ids, starts, n_new)],
                          dtype=torch.float32).view(len(ids), T, 1, 1)
    view.write(0, values, values)
    k, _ = view.gather(0)
    for row, t in enumerate(ids):
        assert k[row, :len(tasks[t]), 0, 0].tolist() == tasks[t], "context read back differs from what was written"
        computed[t] = len(tasks[t])
        cache.task_record_hashes(t, tasks[t], computed[t])


def _check(cache: KVCache, tasks: dict) -> None:
    pool, alloc = cache.pool, cache.pool.allocator
    held = Counter()
    for t in tasks:
        pages = cache._table.get(t)
        assert len(pages) == len(set(pages)), "a task holds a page twice"
        assert len(pages) * PAGE >= len(tasks[t])
        held.update(pages)
    for page in range(PAGES):
        assert alloc.ref_count(page) == held[page], f"page {page}: refcount disagrees with its owners"
        if alloc.is_cached(page):
            assert held[page] == 0 and pool._prefix.has_page(page)
    stats = cache.stats()
    assert stats["pages_free"] + stats["pages_used"] + stats["pages_cached"] == PAGES
    assert stats["pages_used"] == len(held)


@settings(max_examples=60, deadline=None)
@given(st.lists(op_st, min_size=1, max_size=30))
def test_random_operations_keep_cache_consistent(ops):
    cache = KVCache(n_layers=1, cache_shapes=((1, 1), (1, 1)), num_pages=PAGES, page_size=PAGE)
    tasks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    counter = 0
    for op, arg in ops:
        if op == "alloc":
            tid = f"t{counter}"
            counter += 1
            if cache.task_alloc(tid, arg):
                tasks[tid], computed[tid] = list(arg), cache.task_cached(tid)
                assert computed[tid] < len(arg) and computed[tid] % PAGE == 0
                _compute(cache, tasks, computed, [tid])
        elif op == "fork":
            tid = f"t{counter}"
            counter += 1
            donor = max(((t, _common(tasks[t], arg)) for t in tasks), key=lambda d: d[1], default=None)
            if cache.task_alloc(tid, arg, donor=donor):
                tasks[tid], computed[tid] = list(arg), cache.task_cached(tid)
                assert computed[tid] < len(arg)
                if donor is not None:
                    assert computed[tid] >= min(donor[1], len(arg) - 1), "the donor's tokens were not taken"
                _compute(cache, tasks, computed, [tid])
        elif op == "grow":
            grown = []
            for tid in list(tasks):
                if cache.task_extend(tid, len(tasks[tid]) + len(arg)):
                    tasks[tid] += arg
                    grown.append(tid)
            _compute(cache, tasks, computed, grown)
        elif tasks:
            tid = sorted(tasks)[arg % len(tasks)]
            cache.task_free(tid)
            del tasks[tid], computed[tid]
        _check(cache, tasks)
    for tid in list(tasks):
        cache.task_free(tid)
    stats = cache.stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_cached"] == PAGES


def test_prefix_match_needs_exact_tokens_under_same_parent():
    cache = KVCache(n_layers=1, cache_shapes=((1, 1), (1, 1)), num_pages=8, page_size=2)
    assert cache.task_alloc("a", [1, 2, 3, 4, 5])
    cache.task_record_hashes("a", [1, 2, 3, 4, 5], 5)
    assert cache.task_alloc("b", [1, 2, 3, 4, 9]) and cache.task_cached("b") == 4
    # same second page content under a different first page: no match at all
    assert cache.task_alloc("c", [7, 7, 3, 4, 9]) and cache.task_cached("c") == 0
    # a prompt that is entirely cached still recomputes its last page
    assert cache.task_alloc("d", [1, 2, 3, 4]) and cache.task_cached("d") == 2


def test_a_donor_gives_the_tokens_of_its_partial_page_by_copy():
    cache = KVCache(n_layers=1, cache_shapes=((1, 1), (1, 1)), num_pages=8, page_size=4)
    a = [1, 2, 3, 4, 5, 6, 7]
    tasks, computed = {"a": a}, {}
    assert cache.task_alloc("a", a)
    computed["a"] = cache.task_cached("a")
    _compute(cache, tasks, computed, ["a"])
    # the same prompt: page 0 from the prefix cache, positions 4 and 5 copied, the last computed
    assert cache.task_alloc("b", a, donor=("a", 7)) and cache.task_cached("b") == 6
    pages_a, pages_b = cache.task_pages("a"), cache.task_pages("b")
    assert pages_b[0] == pages_a[0] and pages_b[1] != pages_a[1], "a page not yet full is copied, not shared"
    tasks["b"], computed["b"] = a, 6
    _compute(cache, tasks, computed, ["b"])
    # a donor that holds fewer tokens gives only those; an unknown donor gives nothing
    assert cache.task_alloc("c", a + [8], donor=("a", 5)) and cache.task_cached("c") == 5
    assert cache.task_alloc("d", a, donor=("gone", 7)) and cache.task_cached("d") == 4


def test_eviction_only_when_nothing_is_free_and_forgets_descendants():
    cache = KVCache(n_layers=1, cache_shapes=((1, 1), (1, 1)), num_pages=4, page_size=2)
    assert cache.task_alloc("a", [1, 2, 3, 4, 5])  # 3 pages
    cache.task_record_hashes("a", [1, 2, 3, 4, 5], 5)
    cache.task_free("a")
    assert cache.stats() == {"pages_total": 4, "pages_used": 0, "pages_free": 2, "pages_cached": 2}
    assert cache.task_alloc("b", [9, 9, 9])  # 2 pages: the free ones first, the cache stays
    assert cache.stats()["pages_cached"] == 2
    assert cache.task_alloc("c", [8]) and cache.stats()["pages_cached"] == 1  # evicts the LRU leaf
    assert cache.task_alloc("d", [8]) and cache.stats()["pages_cached"] == 0
    assert not cache.task_alloc("e", [8])  # everything in use: refused, nothing held
    assert cache.stats()["pages_used"] == 4
