"""A cached page is shared only under the same parent prefix: its K/V depend on every token before it."""

from __future__ import annotations

import random

import pytest

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.cache.prefix_cache import ROOT, PrefixCache
from inference_helpers import greedy_reference, make_model


def test_equal_page_under_another_parent_is_not_matched():
    cache = PrefixCache(page_size=2)
    assert cache.record(0, [1, 2]) and cache.record(1, [3, 4], parent_page=0)
    assert cache.record(2, [7, 7], parent_page=ROOT)
    assert cache.lookup([1, 2, 3, 4, 9]) == [0, 1]
    assert cache.lookup([7, 7, 3, 4, 9]) == [2]  # [3, 4] is cached, but after [1, 2], not after [7, 7]
    assert cache.record(3, [3, 4], parent_page=2)  # the same tokens under the other parent are a new page
    assert cache.lookup([7, 7, 3, 4, 9]) == [2, 3]


@pytest.mark.timeout(120)
def test_engine_does_not_reuse_a_second_page_computed_after_another_first_page():
    """Both first pages are cached when the third prompt arrives: matching its second page by tokens
    alone would hand it K/V computed after the other first page, and change its greedy output."""
    rng = random.Random(5)
    first_a, first_b, second = ([rng.randrange(256) for _ in range(4)] for _ in range(3))
    prompts = [first_a + second + [11, 12], first_b + [rng.randrange(256) for _ in range(4)] + [13],
               first_b + second + [14, 15]]
    model = make_model("tiny", seed=3)
    expected = [greedy_reference(model, p, 6) for p in prompts]
    with InferenceEngine(model, None, page_size=4, num_pages=64) as engine:
        got = [engine.submit(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)).result(timeout=60).token_ids
               for p in prompts]  # one at a time: each finds the earlier prompts' pages cached
    assert got == expected
