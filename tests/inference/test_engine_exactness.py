"""The engine's greedy output equals full recomputation with the plain model, token for token."""

from __future__ import annotations

import threading

import pytest

from astrai.inference import InferenceEngine, SamplingParams
from inference_helpers import greedy_reference, make_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tiny", "tiny-mla", "tiny-moe"])
def test_staggered_batch_matches_full_recomputation(kind):
    model = make_model(kind)
    prompts = _prompts(1, [5, 13, 1, 21, 8])
    n_out = [12, 7, 10, 9, 14]
    expected = [greedy_reference(model, p, n) for p, n in zip(prompts, n_out)]
    with InferenceEngine(model, None, max_batch_size=4, page_size=4, num_pages=64, prefill_chunk_size=8) as engine:
        first = engine.submit(prompts[0], SamplingParams(max_tokens=n_out[0], **GREEDY))
        events = iter(first)
        head = [next(events) for _ in range(3)]  # later requests join while the first decodes
        handles = [engine.submit(p, SamplingParams(max_tokens=n, **GREEDY)) for p, n in zip(prompts[1:], n_out[1:])]
        rest = [ev for ev in events]
        got_first = [t for ev in head + rest for t in ev.token_ids]
        got = [got_first] + [h.result(timeout=60).token_ids for h in handles]
    assert got == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk", [3, 64])
def test_chunked_prefill_matches(gqa_model, chunk):
    prompts = _prompts(2, [40, 17, 33])
    expected = [greedy_reference(gqa_model, p, 6) for p in prompts]
    with InferenceEngine(gqa_model, None, page_size=4, num_pages=64, prefill_chunk_size=chunk) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=6, **GREEDY)) for p in prompts]
        assert [h.result(timeout=60).token_ids for h in handles] == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tiny", "tiny-mla"])
def test_prefix_sharing_gives_identical_output(kind):
    model = make_model(kind, seed=3)
    system = _prompts(3, [24])[0]
    tails = _prompts(4, [3, 5, 0])
    prompts = [system + t for t in tails] + [system[:9]]
    expected = [greedy_reference(model, p, 8) for p in prompts]
    with InferenceEngine(model, None, page_size=4, num_pages=64) as engine:
        got = []
        for p in prompts:  # one at a time, so later requests find the earlier pages cached
            got.append(engine.submit(p, SamplingParams(max_tokens=8, **GREEDY)).result(timeout=60).token_ids)
        stats = engine.get_stats()
    assert got == expected
    assert stats["prefix_hit_rate"] > 0.4
    # the same prompt twice: the second run reuses every full page but the last and matches
    with InferenceEngine(model, None, page_size=4, num_pages=64) as engine:
        a = engine.submit(prompts[0], SamplingParams(max_tokens=8, **GREEDY)).result(timeout=60).token_ids
        b = engine.submit(prompts[0], SamplingParams(max_tokens=8, **GREEDY)).result(timeout=60).token_ids
        assert a == b == expected[0]
        assert engine.get_stats()["prefix_hit_rate"] > 0.3


@pytest.mark.timeout(120)
def test_concurrent_shared_prefix_waits_for_cache(gqa_model, monkeypatch):
    """Requests sharing a prefix that arrive together compute it once and still match; their
    suffixes are prefilled together, reading the shared pages once (cascade attention)."""
    from astrai.backends.cpu import attention

    split_rows = []
    real_split = attention.attend_shared_prefix

    def spy(q, shared, suffix, suffix_mask):
        split_rows.append((q.shape[0], shared[0].shape[0]))
        return real_split(q, shared, suffix, suffix_mask)

    monkeypatch.setattr(attention, "attend_shared_prefix", spy)
    system = _prompts(5, [32])[0]
    prompts = [system + [i, i + 1] for i in range(6)]
    expected = [greedy_reference(gqa_model, p, 5) for p in prompts]
    with InferenceEngine(gqa_model, None, page_size=4, num_pages=128, prefill_chunk_size=8) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=5, **GREEDY)) for p in prompts]
        got = [h.result(timeout=60).token_ids for h in handles]
        hit = engine.get_stats()["prefix_hit_rate"]
    assert got == expected
    assert hit > 0.6
    assert any(rows > 1 and shared >= 28 for rows, shared in split_rows), split_rows


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tiny", "tiny-mla"])
def test_samples_of_one_prompt_compute_it_once(kind):
    """Requests with one prompt (a GRPO group, n completions) copy the first one's last page,
    which is not full, and compute only their last token; their output is unchanged."""
    model = make_model(kind, seed=4)
    prompt = _prompts(6, [14])[0]  # page 0 shared, positions 8-12 copied, 13 computed
    expected = greedy_reference(model, prompt, 6)
    with InferenceEngine(model, None, page_size=8, num_pages=64) as engine:
        with engine.scheduler._lock:  # all five queued before the loop plans: none finds the first gone
            handles = [engine.submit(prompt, SamplingParams(max_tokens=6, **GREEDY)) for _ in range(5)]
        got = [h.result(timeout=60).token_ids for h in handles]
        assert engine.get_stats()["prefix_hit_rate"] == pytest.approx(4 * 13 / (5 * 14))
        # one that arrives while another decodes copies from the decoding task: it is submitted
        # from the donor's first event, on the loop's thread under its lock, so the donor still
        # decodes and holds its pages however fast the machine runs its 200 tokens
        late_handles, donor_done = [], threading.Event()

        def on_donor_event(event):
            if not late_handles:
                assert not event.finished
                late_handles.append(engine.submit(prompt, SamplingParams(max_tokens=6, **GREEDY)))
            if event.finished:
                donor_done.set()

        engine.scheduler.submit_task(prompt, SamplingParams(max_tokens=200, **GREEDY), stream_callback=on_donor_event)
        assert donor_done.wait(60)
        late = late_handles[0].result(timeout=60).token_ids
        assert engine.get_stats()["prefix_hit_rate"] == pytest.approx((4 * 13 + 8 + 13) / (7 * 14))
    assert got == [expected] * 5 and late == expected
