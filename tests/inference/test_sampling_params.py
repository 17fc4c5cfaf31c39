"""Sampling: filters never let a filtered token through, seeds reproduce, per-request params, logprobs."""

from __future__ import annotations

import re

import pytest
import torch

from astrai.errors import RequestError
from astrai.inference import InferenceEngine, SamplingParams, SamplingPipeline
from astrai.inference.sampling import (FIRST_RANKS, RANKS_GROWTH, MinPStrategy, TopKStrategy, TopPStrategy,
                                      apply_penalties, draw)
from inference_helpers import greedy_reference, make_model


def _counts(pipeline, logits, n=3000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = logits.expand(n, -1)
    probs = pipeline.apply(rows.clone()).softmax(-1)
    return torch.bincount(draw(probs, [gen] * n), minlength=logits.shape[-1])


def test_filters_never_emit_filtered_tokens_and_keep_the_rest():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 2
    order = logits[0].argsort(descending=True)
    probs = logits[0].softmax(-1)
    counts = _counts(SamplingPipeline([TopKStrategy(5)]), logits)
    assert set(counts.nonzero().flatten().tolist()) == set(order[:5].tolist())
    # top-p: the smallest prefix of sorted tokens reaching 0.6
    cum = probs[order].cumsum(0)
    keep_n = int((cum < 0.6).sum()) + 1
    counts = _counts(SamplingPipeline([TopPStrategy(0.6)]), logits)
    assert set(counts.nonzero().flatten().tolist()) <= set(order[:keep_n].tolist())
    assert counts[order[0]] > 0
    counts = _counts(SamplingPipeline([MinPStrategy(0.3)]), logits)
    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    assert set(counts.nonzero().flatten().tolist()) <= allowed
    # the unfiltered draw follows the distribution (a loose statistical check)
    counts = _counts(SamplingPipeline([]), logits, n=20000)
    assert torch.allclose(counts.float() / 20000, probs, atol=0.02)


def test_per_row_parameters_in_one_batch():
    logits = torch.randn(3, 40)
    out = SamplingPipeline.from_params(top_k=torch.tensor([1, 3, 0])).apply(logits.clone())
    finite = torch.isfinite(out).sum(-1).tolist()
    assert finite == [1, 3, 40]


def test_one_rows_settings_filter_every_row_by_its_own_values():
    """A verify step applies one request's settings to each of its positions: every row is
    filtered by its own k-th logit and its own mass, as if it were alone."""
    torch.manual_seed(1)
    logits = torch.randn(3, 30) * 3
    one_row = SamplingPipeline.for_rows([0.9], [8], [0.8], [0.05], logits.device)
    together = one_row.apply(logits.clone())
    for i in range(3):
        assert torch.equal(together[i], one_row.apply(logits[i:i + 1].clone())[0])
        assert int(torch.isfinite(together[i]).sum()) <= 8


def test_unused_strategies_are_left_out_and_change_no_draw():
    """for_rows keeps only the strategies some row uses; a row that leaves a strategy at its neutral value
    gets exactly the logits it would get through it, so a request's draws do not depend on its batch."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 6
    settings = dict(temperature=[1.0, 0.7, 1.0, 1.0], top_k=[0, 0, 20, 0], top_p=[1.0, 1.0, 1.0, 0.9],
                    min_p=[0.0, 0.0, 0.0, 0.0])
    chosen = SamplingPipeline.for_rows(**settings, device=logits.device)
    assert [type(s).__name__ for s in chosen.strategies] == ["TemperatureStrategy", "TopKStrategy", "TopPStrategy"]
    full = SamplingPipeline.from_params(*(torch.tensor(v) for v in settings.values()))
    assert torch.equal(chosen.apply(logits.clone()), full.apply(logits.clone()))
    neutral = SamplingPipeline.for_rows([1.0] * 4, [0] * 4, [1.0] * 4, [0.0] * 4, logits.device)
    assert neutral.strategies == []
    assert torch.equal(full.apply(logits.clone())[0], logits[0])  # row 0 is neutral everywhere


def reference_top_k(logits, k):
    """The definition, by a full sort: keep logits >= the row's k-th largest (k 0 or >= V: all)."""
    out = logits.clone()
    for i, ki in enumerate(k):
        if 0 < ki < logits.shape[1]:
            kth = logits[i].sort(descending=True).values[ki - 1]
            out[i][logits[i] < kth] = float("-inf")
    return out


def reference_top_p(logits, p):
    """The definition, by a full sort: keep the most likely tokens until their mass reaches p,
    and every token tied with the least likely one kept."""
    out = logits.clone()
    for i, pi in enumerate(p):
        if pi < 1:
            values, _ = logits[i].sort(descending=True)
            probs = values.softmax(-1)
            kept = int(((probs.cumsum(-1) - probs) < pi).sum().clamp_min(1))
            out[i][logits[i] < values[kept - 1]] = float("-inf")
    return out


@pytest.mark.parametrize("seed", range(4))
def test_top_k_and_top_p_match_their_full_sort_definitions(seed):
    """Top-k takes a partial top-k and top-p ranks only the tokens left in; per-row settings,
    ties at the k-th value (rounded logits) and rows that keep everything included."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(6, 500, generator=gen) * 4).round()  # many ties
    k = [0, 1, 7, 50, 500, 3]
    p = [1.0, 0.5, 0.9, 0.95, 0.3, 1.0]
    top_k = TopKStrategy(torch.tensor(k)).apply(logits.clone())
    assert torch.equal(top_k, reference_top_k(logits, k))
    both = TopPStrategy(torch.tensor(p)).apply(top_k.clone())
    assert torch.equal(torch.isfinite(both), torch.isfinite(reference_top_p(top_k, p)))
    alone = TopPStrategy(torch.tensor(p)).apply(logits.clone())
    assert torch.equal(torch.isfinite(alone), torch.isfinite(reference_top_p(logits, p)))


def test_top_p_ranks_the_whole_vocabulary_only_when_the_first_ranks_fall_short(monkeypatch):
    """A peaked row's cut lies among its FIRST_RANKS most likely tokens, a broader one's among 16
    times as many: no full sort. A flat row (the cut thousands of tokens down) and a batch
    holding a flat and a peaked row still get the exact cut."""
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorts.append(self.shape) or real_sort(self, *a, **k))
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(1, 8192, generator=gen) * 6
    broad = torch.randn(1, 8192, generator=gen) * 1.5
    flat = torch.randn(1, 8192, generator=gen) * 0.1
    kept = [int(reference_top_p(x, [0.9]).isfinite().sum()) for x in (peaked, broad, flat)]
    assert kept[0] < FIRST_RANKS < kept[1] < FIRST_RANKS * RANKS_GROWTH < kept[2]
    for logits in (peaked, broad):
        sorts.clear()
        out = TopPStrategy(0.9).apply(logits.clone())
        assert sorts == [] and torch.equal(out.isfinite(), reference_top_p(logits, [0.9]).isfinite())
    for logits in (flat, torch.cat([peaked, flat]), torch.cat([flat, peaked])):
        p = [0.9] * logits.shape[0]
        sorts.clear()
        out = TopPStrategy(torch.tensor(p)).apply(logits.clone())
        assert len(sorts) == 1 and torch.equal(out.isfinite(), reference_top_p(logits, p).isfinite())


def test_top_p_keeps_ties_at_the_cut_whatever_the_batch_mates():
    """The cut falls among three equal logits: all three stay, whether the batch is ranked by a full
    sort (a mate with the whole vocabulary) or a partial top-k (a mate with most of it filtered)."""
    row = torch.tensor([2.0, 1.0, 1.0, 1.0, -5.0, -5.0, -5.0, -5.0])  # mass before the 2nd tie 0.65 > 0.6
    full_mate = torch.zeros(8)
    filtered_mate = torch.tensor([0.0, 0.0] + [float("-inf")] * 6)
    for mate in (full_mate, filtered_mate):
        out = TopPStrategy(torch.tensor([0.6, 1.0])).apply(torch.stack([row, mate]))
        assert torch.isfinite(out[0]).tolist() == [True] * 4 + [False] * 4
        assert torch.equal(torch.isfinite(out[1]), torch.isfinite(mate))


def test_top_p_of_one_keeps_every_token():
    """Sorted probabilities of a peaked row sum past 1.0 in float32 before the tail; p = 1 still keeps it."""
    torch.manual_seed(0)
    logits = torch.randn(8, 4096) * 8
    probs = logits.softmax(-1).sort(descending=True).values
    assert ((probs.cumsum(-1) - probs) >= 1).any()  # the rounding the filter must not act on
    assert torch.isfinite(TopPStrategy(1.0).apply(logits.clone())).all()


def test_unseeded_rows_share_one_noise_draw(monkeypatch):
    """Seeded rows take noise from their own generator (one call each); all other rows from one call."""
    calls = []
    original = torch.Tensor.uniform_

    def counting(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "uniform_", counting)
    probs = torch.rand(9, 50).softmax(-1)
    seeded = [None] * 9
    seeded[4] = torch.Generator().manual_seed(7)
    ids = draw(probs, seeded, shared=torch.Generator().manual_seed(1))
    assert calls == [(9, 50), (50,)]  # one batched call, one for the seeded row
    again = draw(probs, [None] * 4 + [torch.Generator().manual_seed(7)] + [None] * 4,
                 shared=torch.Generator().manual_seed(1))
    assert torch.equal(ids, again)
    alone = draw(probs[4:5], [torch.Generator().manual_seed(7)])
    assert ids[4] == alone[0]  # the seeded row's token does not depend on its neighbours


def test_penalties():
    row = torch.tensor([2.0, -2.0, 1.0, 0.5])
    apply_penalties(row, context_ids=[0, 1], output_ids=[2, 2], repetition=2.0, frequency=0.5, presence=0.25)
    assert row.tolist() == [1.0, -4.0, 1.0 - 1.0 - 0.25, 0.5]


@pytest.mark.timeout(60)
def test_seeded_sampling_reproducible_regardless_of_batch_mates(gqa_model):
    params = dict(max_tokens=15, temperature=1.3, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
    with InferenceEngine(gqa_model, None, page_size=4, num_pages=128) as engine:
        alone = engine.submit([5, 6, 7], SamplingParams(**params)).result(timeout=30).token_ids
        mates = [engine.submit([9, i], SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True))
                 for i in range(4)]
        # unseeded mates, and one whose min_p adds a filter the seeded request does not use
        mates += [engine.submit([8, i], SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True))
                  for i in range(2)]
        mates.append(engine.submit([7, 7], SamplingParams(max_tokens=20, temperature=1.0, min_p=0.05, ignore_eos=True)))
        crowded = engine.submit([5, 6, 7], SamplingParams(**params))
        other_seed = engine.submit([5, 6, 7], SamplingParams(**{**params, "seed": 99}))
        assert crowded.result(timeout=30).token_ids == alone
        assert other_seed.result(timeout=30).token_ids != alone
        for m in mates:
            m.result(timeout=30)
        # top_k=1 sampling is greedy whatever the temperature; penalties change the greedy path
        greedy = engine.submit([5, 6, 7], SamplingParams(max_tokens=10, temperature=2.0, top_k=1, ignore_eos=True))
        assert greedy.result(timeout=30).token_ids == greedy_reference(gqa_model, [5, 6, 7], 10)
        fresh = engine.submit([5, 6, 7], SamplingParams(max_tokens=12, temperature=0, presence_penalty=2.0,
                                                        repetition_penalty=5.0, ignore_eos=True))
        ids = fresh.result(timeout=30).token_ids
        assert len(set(ids)) == len(ids)


@pytest.mark.timeout(60)
def test_logprobs_match_the_model(gqa_model):
    prompt = [3, 1, 4, 1, 5]
    with InferenceEngine(gqa_model, None, page_size=4, num_pages=32) as engine:
        r = engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                 ignore_eos=True)).result(timeout=30)
    ids = prompt + r.token_ids
    with torch.no_grad():
        ref = gqa_model(torch.tensor([ids]))["logits"][0].float().log_softmax(-1)
    for i, lp in enumerate(r.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == r.token_ids[i]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _, _ in lp.top] == row.topk(3).indices.tolist()


@pytest.mark.parametrize("shape", [(1, 8192), (4, 8192), (49, 8192), (7, 32000), (3, 1000), (64, 256)])
def test_row_argmax_is_argmax_with_the_first_index_on_ties(shape):
    from astrai.inference.sampling import row_argmax

    torch.manual_seed(0)
    x = torch.randn(shape)
    rows, width = shape
    top = x.max() + 1
    x[0, width // 3] = x[0, width - 1] = top  # a tie across blocks
    if rows > 1:
        x[1, 5] = x[1, 6] = top  # a tie inside a block
    if rows > 2:
        x[2] = 0.0  # all equal: index 0
    if rows > 3:
        x[3] = float("-inf")
        x[3, width - 2] = -1e30
    # also a non-contiguous input, and bf16 (which numpy lacks: the two-pass path)
    for values in (x, x.t().contiguous().t(), x.to(torch.bfloat16)):
        assert torch.equal(row_argmax(values), values.argmax(dim=-1))


@pytest.mark.timeout(60)
def test_unseeded_requests_leave_the_global_random_state_alone(gqa_model):
    """Unseeded draws come from the engine's own generator: a caller's torch.manual_seed stream
    (a training loop's, say) does not move because the engine sampled."""
    with InferenceEngine(gqa_model, None, page_size=4, num_pages=64) as engine:
        before = torch.random.get_rng_state()
        handles = [engine.submit([3, i], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
                   for i in range(4)]
        assert all(len(h.result(timeout=30).token_ids) == 6 for h in handles)
        assert torch.equal(torch.random.get_rng_state(), before)


def test_logit_bias_bans_and_forces_tokens():
    model = make_model("tiny", vocab_size=64, max_len=64)
    with InferenceEngine(model, None, max_batch_size=4, max_seq_len=64) as engine:
        prompt = [1, 2, 3]
        plain = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0)).result().token_ids
        banned = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                      logit_bias={t: -100 for t in set(plain)})).result().token_ids
        forced = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.9, seed=1,
                                                      logit_bias={7: 100})).result().token_ids
    assert not set(banned) & set(plain)
    assert forced == [7] * 6


@pytest.mark.parametrize("bias,words", [({64: 1.0}, "not a token id"), ({"3": 1.0}, "not a token id"),
                                        ({3: 101}, "[-100, 100]"), ([3], "must map")])
def test_logit_bias_is_checked(bias, words):
    with InferenceEngine(make_model("tiny", vocab_size=64, max_len=64), None, max_batch_size=2, max_seq_len=64) as engine:
        with pytest.raises(RequestError, match=re.escape(words)):
            engine.submit([1, 2], SamplingParams(max_tokens=2, logit_bias=bias))
