"""Prefill steps of several padded rows attend row by row, without the padding: equal to
the masked attention over the padded block on every real query, chosen only where it
applies, and used by the engine with outputs equal to full recomputation."""

from __future__ import annotations

import random

import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.cache import KVCache
from astrai.model.components import attention
from inference_helpers import greedy_reference, make_model


def test_row_by_row_equals_the_masked_padded_block_on_real_queries():
    torch.manual_seed(0)
    spans = [(0, 5), (3, 7), (0, 1), (6, 2)]  # (start, n): rows 1 and 3 continue a chunked prompt
    B, T, S, H, Hkv, D = len(spans), 7, 9, 4, 2, 8
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    positions = torch.tensor([[s + min(t, n - 1) for t in range(T)] for s, n in spans])
    mask = (torch.arange(S).view(1, 1, S) <= positions.unsqueeze(2)).unsqueeze(1)  # [B, 1, T, S]
    want = attention._attend(q, k, v, mask)
    got = attention._attend_rows(q, k, v, mask, spans)
    for b, (_, n) in enumerate(spans):
        assert torch.allclose(got[b, :n], want[b, :n], atol=1e-5), b
        assert not got[b, n:].any()  # padding queries: zero


def _bind(n_new, start):
    cache = KVCache(n_layers=1, cache_shapes=((2, 8), (2, 8)), num_pages=32, page_size=4)
    table = torch.arange(len(n_new) * 4).view(len(n_new), 4)  # four distinct pages per row
    return cache.bind(table, start, n_new)


def test_views_ask_for_rows_only_for_several_padded_prefill_rows():
    assert _bind([5, 3], [0, 0]).row_spans == [(0, 5), (0, 3)]
    assert _bind([4, 2], [4, 0]).row_spans == [(4, 4), (0, 2)]
    assert _bind([6], [0]).row_spans is None  # one row: the causal fast path already
    assert _bind([3, 3], [0, 0]).row_spans is None  # uniform rows from 0: no mask, causal already
    assert _bind([1, 1], [4, 9]).row_spans is None  # decode: one query per row


def test_engine_prefill_of_mixed_rows_runs_row_by_row_and_matches_recomputation(monkeypatch):
    calls = []
    real = attention._attend_rows
    monkeypatch.setattr(attention, "_attend_rows", lambda q, k, v, m, spans: calls.append(spans) or real(q, k, v, m, spans))
    model = make_model("tiny")
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 40))] for _ in range(8)]
    expected = [greedy_reference(model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=8, page_size=4, num_pages=128, prefill_chunk_size=48,
                         prefix_cache=False) as engine:
        got = [h.result(timeout=60).token_ids for h in [engine.submit(p, params) for p in prompts]]
    assert got == expected
    assert calls and any(len(spans) > 1 for spans in calls)
    assert any(start > 0 for spans in calls for start, _ in spans)  # a chunked prompt's later chunk
