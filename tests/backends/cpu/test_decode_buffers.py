"""The CPU runner's decode buffers (astrai/backends/cpu/decode_buffers.py): decode steps read
contexts from dense buffers kept across steps, equal to a plain gather from the pages through
joins, leaves and growth, within their memory budget."""

from __future__ import annotations

import pytest
import torch

from astrai.backends.cpu import decode_buffers
from astrai.backends.cpu.attention import DecodeView
from astrai.inference.cache import KVCache


def _decode_view(cache: KVCache, buffers, table, starts, ids) -> DecodeView:
    """The view the CPU runner binds for a decode step of ``ids`` (see CpuModelRunner.bind)."""
    refill = buffers.plan(ids, starts)
    assert refill is not None
    return DecodeView(cache.storage, table, [cache.task_pages(t) for t in ids], starts, buffers, refill)


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
    dense = decode_buffers.DecodeBuffers(cache.storage)
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
        fast = _decode_view(cache, dense, table, starts, ids)
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
    dense = decode_buffers.DecodeBuffers(cache.storage)
    lens = {"a": 3, "b": 6, "c": 2, "d": 5}
    for tid, n in lens.items():
        assert cache.task_alloc(tid, list(range(n)))
        cache.bind(cache.make_table_tensor([tid]), [0], [n]).write(0, torch.randn(1, n, 2, 3), torch.randn(1, n, 2, 3))
    full_moves = []
    monkeypatch.setattr(decode_buffers.DecodeBuffers, "_move_rows", lambda self, rows: full_moves.append(rows))

    def step(ids):
        order = dense.preferred_order(ids, [lens[t] for t in ids])
        ordered = [ids[i] for i in order]
        for tid in ordered:
            assert cache.task_extend(tid, lens[tid] + 1)
        table = cache.make_table_tensor(ordered)
        starts = [lens[t] for t in ordered]
        fast = _decode_view(cache, dense, table, starts, ordered)
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
    for budget, expected in ((10**9, [1, 8, 16, 32, 64]), (40 * bytes_per_row, [1, 8, 16, 32, 40])):
        buffers = decode_buffers.DecodeBuffers(cache.storage, budget_bytes=budget)
        sizes = []
        for n in range(1, 34):
            assert buffers.plan([f"t{i}" for i in range(n)], [3] * n) is not None
            if buffers.rows not in sizes:
                sizes.append(buffers.rows)
        assert sizes == expected


def test_a_batch_past_the_budget_releases_the_buffers():
    """When even the batch's own rows do not fit, the step gathers from the pages and the
    buffers are freed, not kept beside a cache that is now full of long contexts; a batch that
    fits again gets new ones."""
    cache = KVCache(n_layers=1, cache_shapes=((1, 2), (1, 2)), num_pages=600, page_size=4)
    per_row = 2 * cache.storage.bytes_per_token()
    buffers = decode_buffers.DecodeBuffers(cache.storage, budget_bytes=3 * 1000 * per_row)
    assert buffers.plan(["a", "b"], [4, 3]) is not None and buffers.k
    assert buffers.plan(["a", "b", "c", "d"], [900, 900, 900, 900]) is None
    assert buffers.k == [] and buffers.v == [] and buffers.rows == buffers.capacity == 0 and not buffers.valid
    assert buffers.plan(["e"], [5]) == [0] and buffers.rows == 1 and buffers.k


def test_a_long_context_takes_the_buffers_with_no_spare_rows():
    """A row whose context is too long for the rounded-up group of rows within the budget
    still gets buffers of its own: rows for the batch only, the held rows carried over (a
    long context must not fall back to gathering its whole context every step). A single
    stream holds no spare rows at all: each would be zeroed before use."""
    cache = KVCache(n_layers=1, cache_shapes=((1, 2), (1, 2)), num_pages=600, page_size=4)
    per_row = 2 * cache.storage.bytes_per_token()  # both sets, per token of capacity
    buffers = decode_buffers.DecodeBuffers(cache.storage, budget_bytes=3 * 1000 * per_row)
    assert buffers.plan(["a"], [3]) == [0]
    assert buffers.rows == 1
    assert buffers.plan(["a", "b"], [4, 3]) == [1]
    assert buffers.rows == decode_buffers.ROW_STEP
    buffers.k[0][0, 0, :3] = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert buffers.plan(["a", "b"], [900, 4]) is not None  # 900 tokens + headroom: eight rows would not fit
    assert buffers.rows == 2 and buffers.capacity >= 901
    assert buffers.k[0][0, 0, :3].tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
