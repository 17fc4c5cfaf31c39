"""Runs of greedy decode steps in one call into C (the engine's ``greedy_run_steps``,
Executor.execute_greedy_steps, kernels.decode_steps): a lone greedy request takes up
to eight steps per loop step, with the tokens of full recomputation; a stop id ends the run
inside the kernel, a stop string drops the rest of it, max_tokens is never passed; a request
that arrives meanwhile is served exactly; and runs stay off where the logits themselves are
needed (sampling, penalties, log-probabilities)."""

from __future__ import annotations

import pytest
import torch

from astrai.errors import RequestError
from astrai.inference import InferenceEngine, SamplingParams
from astrai.backends.cpu import fused_decode as fused_module
from astrai.backends.cpu.decode_buffers import DecodeBuffers
from astrai.backends.cpu.kernels import kernels_available
from astrai.inference.scheduler import GREEDY_RUN_SECONDS
from inference_helpers import greedy_reference, make_model, with_uneven_norms

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

PROMPT = [5, 9, 200, 3]


@pytest.fixture
def runs(monkeypatch):
    """(steps asked, tokens returned) of every call that ran several steps."""
    calls = []
    real = fused_module.decode_steps

    def recording(plan, token, pos, kv_offsets, stop_ids, embedding_rows, max_seconds):
        tokens = real(plan, token, pos, kv_offsets, stop_ids, embedding_rows, max_seconds)
        calls.append((len(kv_offsets), len(tokens)))
        return tokens

    monkeypatch.setattr(fused_module, "decode_steps", recording)
    return calls


def _engine(model, **settings):
    """An engine whose runs end by steps only (unless told otherwise), so their lengths do
    not hang on how fast this machine runs them."""
    return InferenceEngine(model, None, **{"max_batch_size": 1, "page_size": 4, "num_pages": 96,
                                           "greedy_run_seconds": float("inf"), **settings})


def _greedy(max_tokens=20, **fields):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **{"ignore_eos": True, **fields})


def _first_new(tokens: list[int], lo: int, hi: int) -> int:
    """An index i in [lo, hi) whose token does not occur before it (so a stop on it stops there)."""
    return next(i for i in range(lo, hi) if tokens[i] not in tokens[:i])


@pytest.mark.timeout(60)
def test_a_lone_greedy_request_decodes_in_runs_with_the_tokens_of_recomputation(runs, monkeypatch):
    """... and the decode buffers count each run's tokens: the row is copied from the pages
    once, after the prefill, and never again."""
    refills = []
    real_fill = DecodeBuffers.fill_row
    monkeypatch.setattr(DecodeBuffers, "fill_row", lambda self, row, slots: refills.append(row) or real_fill(self, row, slots))
    model = make_model("tiny")
    with _engine(model) as engine:
        result = engine.submit(PROMPT, _greedy(20)).result(timeout=60)
        assert engine.get_stats()["pages_used"] == 0
    assert result.token_ids == greedy_reference(model, PROMPT, 20) and result.finish_reason == "length"
    assert runs == [(8, 8), (8, 8), (3, 3)]  # the prefill gave the first of the 20 tokens; none past max_tokens
    assert refills == [0]


@pytest.mark.timeout(60)
def test_runs_on_several_threads_give_the_same_tokens(runs):
    """The C loop runs every step of a run in one parallel region, the matmuls and attention
    shared among the threads: three threads (an uneven split) decode what one does."""
    model = with_uneven_norms(make_model("tiny", n_heads=6, n_kv_heads=3, dim=96))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            with _engine(model) as engine:
                results.append(engine.submit(PROMPT, _greedy(20)).result(timeout=60).token_ids)
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1] == greedy_reference(model, PROMPT, 20)
    assert len(runs) == 6


@pytest.mark.timeout(60)
def test_runs_go_on_through_a_growth_of_the_decode_buffers(runs):
    """A run that would pass the decode buffers' capacity has them grown first, so every step
    after the prefill still runs inside a run, and the tokens stay exact."""
    model = make_model("tiny", max_len=512)
    prompt = [9, 4, 1]
    with _engine(model) as engine:
        result = engine.submit(prompt, _greedy(300)).result(timeout=60)
        assert engine.scheduler._runner.decode_buffers.generation >= 2  # made once, grown at least once
    assert result.token_ids == greedy_reference(model, prompt, 300)
    assert sum(done for _, done in runs) == 299


@pytest.mark.timeout(60)
def test_a_stop_id_ends_the_run_inside_the_kernel(runs):
    """The request's own stop id, and the engine's (eos) unless ignore_eos, end the C loop at
    once: no step is computed past the stop, and every page is released."""
    model = make_model("tiny")
    expected = greedy_reference(model, PROMPT, 20)
    i = _first_new(expected, 2, 8)
    with _engine(model) as engine:
        own = engine.submit(PROMPT, _greedy(20, stop_token_ids=[expected[i]])).result(timeout=60)
        assert engine.get_stats()["pages_used"] == 0
    with _engine(model, stop_ids=[expected[i]]) as engine:
        eos = engine.submit(PROMPT, _greedy(20, ignore_eos=False)).result(timeout=60)
        ignored = engine.submit(PROMPT, _greedy(20)).result(timeout=60)
    for result in (own, eos):
        assert result.token_ids == expected[:i + 1] and result.finish_reason == "stop"
    assert ignored.token_ids == expected
    assert runs[:2] == [(8, i), (8, i)] and runs[2:] == [(8, 8), (8, 8), (3, 3)]


@pytest.mark.timeout(60)
def test_a_stop_string_inside_a_run_drops_the_rest_of_it(runs, tokenizer):
    model = make_model("tiny", seed=3, vocab_size=tokenizer.vocab_size)  # a text that is not one token repeated
    with InferenceEngine(model, tokenizer, page_size=8, num_pages=96) as engine:
        prompt = engine.encode_prompt("abc")
        full = engine.submit(prompt, _greedy(30)).result(timeout=60)
        text, start = full.text, len(tokenizer.decode(full.token_ids[:2]))
        # two characters first met after the second token's text: the stop falls inside the first run
        stop = next(text[k:k + 2] for k in range(start, len(text) - 1) if text.index(text[k:k + 2]) == k)
        computed_before = sum(done for _, done in runs)
        cut = engine.submit(prompt, _greedy(30, stop=[stop])).result(timeout=60)
        assert engine.get_stats()["pages_used"] == 0
        again = engine.submit(prompt, _greedy(30, stop=[stop])).result(timeout=60)  # through the prefix cache
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    assert sum(done for _, done in runs) - computed_before > 2 * (len(cut.token_ids) - 1)  # steps past the stop ran
    assert again.token_ids == cut.token_ids and again.text == cut.text


@pytest.mark.timeout(60)
def test_a_request_arriving_during_runs_is_served_exactly(runs):
    """The newcomer joins after the run under way; both then decode as one batch, and the
    survivor runs again."""
    model = make_model("tiny", max_len=512)
    other = [17, 4, 4, 90, 31, 2]
    with _engine(model, max_batch_size=2) as engine:
        first = engine.submit(PROMPT, _greedy(300))
        next(iter(first))
        second = engine.submit(other, _greedy(24)).result(timeout=60)
        rest = first.result(timeout=60)
    assert second.token_ids == greedy_reference(model, other, 24)
    assert rest.token_ids == greedy_reference(model, PROMPT, 300)
    assert runs and sum(done for _, done in runs) < 299  # runs before and after, batched steps between


@pytest.mark.timeout(60)
def test_a_token_the_embedding_has_no_row_for_ends_the_run(runs):
    """The kernel stops after a token it could not look up (``embedding_rows``) and the next
    step goes through the model's own forward: here the fused step is told the embedding is
    smaller than it is, so the model's forward can still take the token."""
    model = make_model("tiny")
    expected = greedy_reference(model, PROMPT, 20)
    i = _first_new(expected, 2, 8)
    with _engine(model) as engine:
        engine.submit(PROMPT, _greedy(2)).result(timeout=60)  # builds the fused step's table
        fused = engine.scheduler._runner.fused_decode
        limit = expected[i]
        fused._vocab = limit
        runs.clear()
        result = engine.submit(PROMPT, _greedy(20)).result(timeout=60)
    assert result.token_ids == expected
    stopped = [done for _, done in runs]
    assert stopped[0] == next(j for j in range(1, 9) if expected[j] >= limit)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fields", [dict(temperature=0.8, seed=1), dict(logprobs=True), dict(top_logprobs=2),
                                    dict(repetition_penalty=1.5), dict(presence_penalty=0.5)])
def test_runs_stay_off_where_the_logits_are_needed(runs, fields):
    model = make_model("tiny")
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **fields})
    with _engine(model) as engine:
        assert len(engine.submit(PROMPT, params).result(timeout=60).token_ids) == 12
    assert runs == []


@pytest.mark.timeout(60)
def test_the_run_length_is_an_engine_setting(runs):
    """``greedy_run_steps`` sets the run length (1: a token per call, as sampled requests
    take them), and a length that is not a positive integer is refused with its name."""
    model = make_model("tiny")
    expected = greedy_reference(model, PROMPT, 20)
    for steps, calls in ((3, [(3, 3)] * 6), (1, [])):  # the 19th step alone takes the one-step call
        runs.clear()
        with _engine(model, greedy_run_steps=steps) as engine:
            assert engine.submit(PROMPT, _greedy(20)).result(timeout=60).token_ids == expected
        assert runs == calls
    for bad in (0, -2, 2.5, "8"):
        with pytest.raises(RequestError, match="greedy_run_steps"):
            _engine(model, greedy_run_steps=bad)


@pytest.mark.timeout(60)
def test_a_run_ends_once_it_has_taken_greedy_run_seconds(runs, monkeypatch):
    """The C loop checks the run's time after each step: with no time to spare every run is
    one step, the tokens stay exact, and the decode buffers, told how many steps ran, keep
    the row in place (copied from the pages once, after the prefill)."""
    refills = []
    real_fill = DecodeBuffers.fill_row
    monkeypatch.setattr(DecodeBuffers, "fill_row", lambda self, row, slots: refills.append(row) or real_fill(self, row, slots))
    model = make_model("tiny")
    with _engine(model, greedy_run_seconds=0) as engine:
        result = engine.submit(PROMPT, _greedy(20)).result(timeout=60)
        assert engine.get_stats()["pages_used"] == 0
    assert result.token_ids == greedy_reference(model, PROMPT, 20)
    assert len(runs) == 18 and all(asked == min(8, 19 - i) and done == 1 for i, (asked, done) in enumerate(runs))
    assert refills == [0]


def test_runs_are_bounded_by_greedy_run_seconds_by_default(monkeypatch):
    seen = []
    real = fused_module.decode_steps
    monkeypatch.setattr(fused_module, "decode_steps", lambda *args: seen.append(args[-1]) or real(*args))
    with InferenceEngine(make_model("tiny"), None, max_batch_size=1) as engine:
        engine.submit(PROMPT, _greedy(12)).result(timeout=60)
    assert seen and set(seen) == {GREEDY_RUN_SECONDS} and GREEDY_RUN_SECONDS == 0.05


@pytest.mark.parametrize("bad", [-0.01, float("nan"), "0.05", True, None])
def test_a_bad_run_time_is_refused_by_name(bad):
    with pytest.raises(RequestError, match="greedy_run_seconds"):
        _engine(make_model("tiny"), greedy_run_seconds=bad)
