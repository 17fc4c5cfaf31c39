"""Sampling: filters never let a filtered token through, seeds reproduce, per-request params, logprobs."""

from __future__ import annotations

import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams, SamplingPipeline, StopChecker
from astrai.inference.sampling import MinPStrategy, TopKStrategy, TopPStrategy, apply_penalties, draw
from inference_helpers import greedy_reference


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


def test_penalties():
    row = torch.tensor([2.0, -2.0, 1.0, 0.5])
    apply_penalties(row, context_ids=[0, 1], output_ids=[2, 2], repetition=2.0, frequency=0.5, presence=0.25)
    assert row.tolist() == [1.0, -4.0, 1.0 - 1.0 - 0.25, 0.5]


def test_stop_checker_holds_back_partial_matches():
    s = StopChecker(["</a>", "END"])
    out = [s.push(p) for p in ["hel", "lo <", "/", "a> tail"]]
    assert "".join(t for t, _ in out) == "hello "
    assert out[-1][1] == "</a>"
    s = StopChecker(["</a>"])
    assert s.push("x <") == ("x ", None) and s.push("b") == ("<b", None) and s.flush() == ""


@pytest.mark.timeout(60)
def test_seeded_sampling_reproducible_regardless_of_batch_mates(gqa_model):
    params = dict(max_tokens=15, temperature=1.3, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
    with InferenceEngine(gqa_model, None, page_size=4, num_pages=128) as engine:
        alone = engine.submit([5, 6, 7], SamplingParams(**params)).result(timeout=30).token_ids
        mates = [engine.submit([9, i], SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True))
                 for i in range(4)]
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
    for values in (x, x.t().contiguous().t()):  # also a non-contiguous input
        assert torch.equal(row_argmax(values), values.argmax(dim=-1))
