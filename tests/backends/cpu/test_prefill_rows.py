"""Prefill steps of several rows of different lengths attend row by row, without the
padding, and (GQA on CPU) run packed: every row's tokens in one unpadded row. Equal to the
masked attention over the padded block on every real query, chosen only where it applies,
and used by the engine with outputs equal to full recomputation."""

from __future__ import annotations

import random

import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.backends.cpu import attention
from astrai.backends.cpu.attention import CpuKvcacheView
from astrai.inference.cache import KVCache
from astrai.model.components.attention import attend
from inference_helpers import greedy_reference, make_model


def test_row_by_row_equals_the_masked_padded_block_on_real_queries():
    torch.manual_seed(0)
    spans = [(0, 5), (3, 7), (0, 1), (6, 2)]  # (start, n): rows 1 and 3 continue a chunked prompt
    B, T, S, H, Hkv, D = len(spans), 7, 9, 4, 2, 8
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    positions = torch.tensor([[s + min(t, n - 1) for t in range(T)] for s, n in spans])
    mask = (torch.arange(S).view(1, 1, S) <= positions.unsqueeze(2)).unsqueeze(1)  # [B, 1, T, S]
    want = attend(q, k, v, mask)
    packed_q = torch.cat([q[b:b + 1, :n] for b, (_, n) in enumerate(spans)], dim=1)  # [1, N, H, D]
    packed = attention.attend_rows(packed_q, k, v, mask, spans)
    assert packed.shape == (1, sum(n for _, n in spans), H, D)
    assert torch.allclose(packed, torch.cat([want[b:b + 1, :n] for b, (_, n) in enumerate(spans)], dim=1), atol=1e-5)


def _bind(n_new, start, packed=False):
    cache = KVCache(n_layers=1, cache_shapes=((2, 8), (2, 8)), num_pages=32, page_size=4)
    table = torch.arange(len(n_new) * 4).view(len(n_new), 4)  # four distinct pages per row
    return CpuKvcacheView(cache.storage, table, start, n_new, packed=packed)


def test_views_pack_only_several_prefill_rows_that_need_a_mask():
    assert _bind([5, 3], [0, 0], packed=True).row_spans == [(0, 5), (0, 3)]
    assert _bind([4, 2], [4, 0], packed=True).row_spans == [(4, 4), (0, 2)]
    assert not _bind([6], [0], packed=True).packed  # one row: the causal fast path already
    assert not _bind([3, 3], [0, 0], packed=True).packed  # uniform rows from 0: no mask, causal already
    assert not _bind([1, 1], [4, 9], packed=True).packed  # decode: one query per row
    assert not _bind([5, 3], [0, 0]).packed  # only when the caller asks


def test_a_packed_view_lays_the_rows_tokens_out_one_after_the_other():
    padded, packed = _bind([3, 2], [4, 0]), _bind([3, 2], [4, 0], packed=True)
    assert packed.packed and not _bind([3, 3], [0, 0], packed=True).packed  # nothing to pack
    assert packed.position_ids.tolist() == [[4, 5, 6, 0, 1]]
    assert padded.position_ids.tolist() == [[4, 5, 6], [0, 1, 1]]
    # pages 0-3 are row 0's, 4-7 row 1's (4 slots each): positions 4-6 of row 0 are slots 4-6,
    # positions 0-1 of row 1 slots 16-17; the padded view's third write of row 1 goes to the sink
    assert packed._write_slots.tolist() == [4, 5, 6, 16, 17]
    assert padded._write_slots.tolist()[:5] == [4, 5, 6, 16, 17]
    assert torch.equal(packed.attn_mask, padded.attn_mask)  # per row, for the attention


def test_engine_prefill_of_mixed_rows_runs_row_by_row_and_matches_recomputation(monkeypatch):
    calls = []
    real = attention.attend_rows
    monkeypatch.setattr(attention, "attend_rows",
                        lambda q, k, v, m, spans: calls.append((spans, q.shape[0])) or real(q, k, v, m, spans))
    model = make_model("tiny")
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 40))] for _ in range(8)]
    expected = [greedy_reference(model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=8, page_size=4, num_pages=128, prefill_chunk_size=48,
                         prefix_cache=False) as engine:
        got = [h.result(timeout=60).token_ids for h in [engine.submit(p, params) for p in prompts]]
    assert got == expected
    assert calls and any(len(spans) > 1 for spans, _ in calls)
    assert any(start > 0 for spans, _ in calls for start, _ in spans)  # a chunked prompt's later chunk
    assert all(rows == 1 for _, rows in calls)  # GQA on CPU: one unpadded row


def test_models_without_row_attention_keep_padded_rows(monkeypatch):
    monkeypatch.setattr(attention, "attend_rows", lambda *a: pytest.fail("MLA reads no row_spans"))
    model = make_model("tiny-mla")
    rng = random.Random(12)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 30))] for _ in range(5)]
    expected = [greedy_reference(model, p, 4) for p in prompts]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=5, page_size=4, num_pages=128, prefill_chunk_size=48) as engine:
        assert not engine.scheduler._runner.packs_prefill
        got = [h.result(timeout=60).token_ids for h in [engine.submit(p, params) for p in prompts]]
    assert got == expected


def test_packed_prefill_steps_fill_the_budget_with_real_tokens():
    from types import SimpleNamespace

    waiting = [SimpleNamespace(remaining=n) for n in (300, 300, 100)]
    for kind, packs, plan in (("tiny", True, [300, 212]), ("tiny-mla", False, [300])):
        with InferenceEngine(make_model(kind), None, max_batch_size=8, num_pages=64,
                             prefill_chunk_size=512) as engine:
            scheduler = engine.scheduler
            assert scheduler._runner.packs_prefill is packs
            batch, n_new = scheduler._plan_prefill(waiting)
        # packed: 512 real tokens (the second prompt's rest comes in a later chunk); padded:
        # two rows would cost 2 x 300 padded tokens, so the first prompt goes alone
        assert n_new == plan and batch == waiting[:len(plan)]
    waiting = [SimpleNamespace(remaining=n) for n in (100, 120, 90, 400)]
    with InferenceEngine(make_model("tiny"), None, max_batch_size=8, num_pages=64, prefill_chunk_size=512) as engine:
        assert engine.scheduler._plan_prefill(waiting)[1] == [100, 120, 90, 202]


def test_a_packed_step_may_hold_more_tokens_than_max_len():
    """Prompts of different lengths below max_len prefilled together lay more than max_len
    tokens out in one packed row; every position is still within max_len."""
    model = make_model("tiny", max_len=32)
    prompts = [[(7 * i + j) % 256 for j in range(30 - 5 * i)] for i in range(3)]  # 75 tokens, packed
    expected = [greedy_reference(model, p, 1) for p in prompts]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=3, page_size=4, num_pages=64, prefill_chunk_size=96,
                         prefix_cache=False) as engine:
        with engine.scheduler._lock:  # all three queued before the loop plans its first step
            handles = [engine.submit(p, params) for p in prompts]
        assert [h.result(timeout=60).token_ids for h in handles] == expected
