"""The paged cache under random operation sequences (hypothesis).

Every token's cached "K" is the token id itself, so reading a task's context back
through a bound view shows whether page tables, prefix reuse and padding are right.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from astrai.inference.cache import KVCache, decode_buffers

PAGE, PAGES = 2, 12

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)
op_st = st.one_of(
    st.tuples(st.just("alloc"), tokens_st),
    st.tuples(st.just("grow"), st.lists(st.integers(0, 3), min_size=1, max_size=4)),
    st.tuples(st.just("free"), st.integers(0, 7)),
)


def _compute(cache: KVCache, tasks: dict, computed: dict, ids: list[str]) -> None:
    """Write every task's uncomputed tokens in one multi-row view and read the contexts back."""
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


@pytest.mark.parametrize("growth", ["default", "every step"])
def test_decode_buffers_match_paged_gather_and_avoid_copies(monkeypatch, growth):
    """Decode steps read contexts from dense buffers kept across steps; what they return
    must equal a plain gather from the pages, through joins, leaves and growth, and only
    newcomers' contexts are read from the pages ("every step": the buffers grow by one
    row and one page at a time, and each growth must carry the rows over)."""
    if growth == "every step":
        monkeypatch.setattr(decode_buffers, "HEADROOM", 1)
        monkeypatch.setattr(decode_buffers, "ROW_STEP", 1)
    # fresh memory is NaN here: every position the buffers do not fill must still be zeroed,
    # since masked positions are multiplied too (NaN * 0 is NaN)
    monkeypatch.setattr(decode_buffers.torch, "empty", lambda *shape, **kw: torch.full(shape, float("nan"), **kw))
    torch.manual_seed(0)
    cache = KVCache(n_layers=2, cache_shapes=((2, 3), (1, 4)), num_pages=64, page_size=4)
    lens = {"a": 5, "b": 9, "c": 2}
    for tid, n in lens.items():
        assert cache.task_alloc(tid, list(range(n)))
        view = cache.bind(cache.make_table_tensor([tid]), [0], [n])
        for layer in range(2):
            view.write(layer, torch.randn(1, n, 2, 3), torch.randn(1, n, 1, 4))
    schedule = [("a", "b")] * 3 + [("a", "b", "c")] * 2 + [("b", "c")] * 2
    pointers, gathered = [], []
    real_gather = cache.storage.gather

    def counting_gather(layer_id, slots, batch):
        if layer_id == 0 and counting:
            gathered[-1] += batch
        return real_gather(layer_id, slots, batch)

    cache.storage.gather = counting_gather
    for step, ids in enumerate(schedule):
        gathered.append(0)
        for tid in ids:
            assert cache.task_extend(tid, lens[tid] + 1)
        table = cache.make_table_tensor(list(ids))
        starts = [lens[t] for t in ids]
        fast = cache.bind(table, starts, [1] * len(ids), task_ids=ids)
        plain = cache.bind(table, starts, [1] * len(ids))
        for layer in range(2):
            k, v = torch.randn(len(ids), 1, 2, 3), torch.randn(len(ids), 1, 1, 4)
            fast.write(layer, k, v)
            counting = True
            got = fast.gather(layer)
            counting = False
            want = plain.gather(layer)
            for row, tid in enumerate(ids):
                n = lens[tid] + 1
                assert torch.equal(got[0][row, :n], want[0][row, :n]) and torch.equal(got[1][row, :n], want[1][row, :n])
            if layer == 0:
                pointers.append(got[0].data_ptr())
        for tid in ids:
            lens[tid] += 1
        dense = cache._dense
        assert all(torch.isfinite(buf).all() for buf in dense.k + dense.v + dense._spare[0] + dense._spare[1])
    # rows read from the pages: both at first, then only the newcomer c; a leaving task
    # moves the others' rows within the buffers (into the second set), nothing is re-read
    assert gathered == [2, 0, 0, 1, 0, 0, 0]
    if growth == "every step":
        return
    assert pointers[0] == pointers[1] == pointers[2] == pointers[3] == pointers[4]
    assert pointers[4] != pointers[5] == pointers[6]


def test_decode_order_keeps_rows_in_place_when_a_task_leaves(monkeypatch):
    """With the preferred order a finished task's row is taken by the last row's task (one row
    copied in place): no gather from the pages, no move of the whole batch, same contents."""
    torch.manual_seed(1)
    cache = KVCache(n_layers=1, cache_shapes=((2, 3), (2, 3)), num_pages=32, page_size=4)
    lens = {"a": 3, "b": 6, "c": 2, "d": 5}
    for tid, n in lens.items():
        assert cache.task_alloc(tid, list(range(n)))
        cache.bind(cache.make_table_tensor([tid]), [0], [n]).write(0, torch.randn(1, n, 2, 3), torch.randn(1, n, 2, 3))
    full_moves = []
    monkeypatch.setattr(decode_buffers.DecodeBuffers, "_move_rows", lambda self, rows: full_moves.append(rows))

    def step(ids):
        order = cache.decode_order(ids, [lens[t] for t in ids])
        ordered = [ids[i] for i in order]
        for tid in ordered:
            assert cache.task_extend(tid, lens[tid] + 1)
        table = cache.make_table_tensor(ordered)
        starts = [lens[t] for t in ordered]
        fast = cache.bind(table, starts, [1] * len(ordered), task_ids=ordered)
        plain = cache.bind(table, starts, [1] * len(ordered))
        k = torch.randn(len(ordered), 1, 2, 3)
        fast.write(0, k, k)
        got, want = fast.gather(0)[0], plain.gather(0)[0]
        for row, tid in enumerate(ordered):
            assert torch.equal(got[row, :lens[tid] + 1], want[row, :lens[tid] + 1])
            lens[tid] += 1
        return ordered, got.data_ptr()

    step(["a", "b", "c", "d"])
    _, pointer = step(["a", "b", "c", "d"])
    ordered, after = step(["a", "c", "d"])  # b finished: d (last row) takes its row
    assert ordered == ["a", "d", "c"]
    assert after == pointer and full_moves == []


def test_decode_buffers_grow_by_doubling_within_their_budget():
    """A batch that fills up one task at a time reallocates its buffers a logarithmic number
    of times (each growth copies every held row), and never past the memory budget."""
    cache = KVCache(n_layers=1, cache_shapes=((1, 2), (1, 2)), num_pages=8, page_size=4)
    bytes_per_row = 2 * 260 * cache.storage.bytes_per_token()  # both sets, capacity of 3 tokens + headroom, in pages
    for budget, expected in ((10**9, [8, 16, 32, 64]), (40 * bytes_per_row, [8, 16, 32, 40])):
        buffers = decode_buffers.DecodeBuffers(cache.storage, budget_bytes=budget)
        sizes = []
        for n in range(1, 34):
            assert buffers.plan([f"t{i}" for i in range(n)], [3] * n) is not None
            if buffers.rows not in sizes:
                sizes.append(buffers.rows)
        assert sizes == expected
