"""Decoding tasks ride along in prefill steps, one token each after the prompt rows, where the
runner mixes them (the CPU runner, GQA models): every prefill step then also advances every
decoding task, whose attention reads its context in place in the page store."""

from __future__ import annotations

import pytest

from astrai.backends.cpu.kernels import kernels_available
from astrai.inference import InferenceEngine, InferenceScheduler, SamplingParams
from inference_helpers import greedy_reference, make_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
SHORT, LONG = [1, 2, 3], list(range(10, 50))  # the long prompt takes six chunks of 7 tokens
CHUNK = 8


def _drive(kind: str):
    """Run a short request to its first token, then a long one beside it, stepping the loop by
    hand; each step's kind and the tokens it fed each task."""
    model = make_model(kind)
    sched = InferenceScheduler(model, None, page_size=4, num_pages=64, prefill_chunk_size=CHUNK,
                                greedy_run_steps=1)  # one token per decode step: the count below is exact
    sched._running = True  # drive the loop by hand instead of on its thread
    tokens = {"short": [], "long": []}
    steps = []
    tasks = {}

    def step() -> None:
        sched._admit()
        step_kind, batch, n_new, drafts = sched._plan_step()
        names = {id(task): name for name, task in tasks.items()}
        steps.append((step_kind, {names.get(id(t), "?"): n for t, n in zip(batch, n_new)}))
        sched._run_step(step_kind, batch, n_new, drafts)

    def submit(name, prompt, max_tokens):
        task_id = sched.add_task(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY),
                                 lambda event: tokens[name].extend(event.token_ids or []))
        tasks[name] = next(t for t in sched._task_mgr.waiting if t.task_id == task_id)

    submit("short", SHORT, 12)
    step()  # the short prompt's prefill: its first token
    submit("long", LONG, 3)
    while not all(t.done for t in tasks.values()):
        step()
    reads = sched._runner.decode_attention_counts()
    sched.stop()
    return steps, tokens, model, reads


@pytest.mark.timeout(60)
@pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")
def test_a_decoding_task_gains_a_token_in_every_prefill_step():
    steps, tokens, model, reads = _drive("tiny")
    chunks = [fed for kind, fed in steps if kind == "prefill" and "long" in fed]
    assert all(fed.get("short") == 1 and sum(fed.values()) <= CHUNK for fed in chunks), chunks
    assert sum(fed["long"] for fed in chunks) == len(LONG)
    assert len(chunks) == 6  # 40 prompt tokens, 7 a step beside the rider
    assert reads["pages"] == len(chunks) and reads["gathered"] == 0, reads  # the rider read its pages in place
    assert tokens["short"] == greedy_reference(model, SHORT, 12)
    assert tokens["long"] == greedy_reference(model, LONG, 3)


@pytest.mark.timeout(60)
def test_a_runner_that_pads_prefill_alternates_prefill_and_decode_steps():
    steps, tokens, model, _ = _drive("tiny-mla")  # MLA prefill rows are padded, not packed
    assert all("short" not in fed for kind, fed in steps if kind == "prefill" and "long" in fed)
    assert any(kind == "decode" and "short" in fed for kind, fed in steps)
    assert tokens["short"] == greedy_reference(model, SHORT, 12)
    assert tokens["long"] == greedy_reference(model, LONG, 3)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")
def test_requests_arriving_while_others_decode_each_get_their_own_tokens():
    """Three requests decoding while two long prompts arrive (packed together, chunked over
    several steps, the first 160 tokens of both already cached by an earlier request: rows
    that would take the shared-prefix path alone) and a sampled one with a seed: every greedy
    request's tokens equal full recomputation's, and the sampled one equals the same request
    run alone."""
    model = make_model("tiny", max_len=512)
    shorts = [[5 + i, 6, 7, 8] for i in range(3)]
    common = list(range(20, 180))
    longs = [common + [200 + i] * 40 for i in range(2)]
    sampled = SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=8, page_size=16, prefill_chunk_size=64, max_seq_len=512) as engine:
        alone = engine.submit(longs[0], sampled).result(timeout=60).token_ids
        first = [engine.submit(p, SamplingParams(max_tokens=40, **GREEDY)) for p in shorts]
        for handle in first:
            next(iter(handle))  # decoding before the long prompts arrive
        later = [engine.submit(p, SamplingParams(max_tokens=6, **GREEDY)) for p in longs]
        mixed = engine.submit(longs[0], sampled)
        got = [h.result(timeout=60).token_ids for h in first + later]
        again = mixed.result(timeout=60).token_ids
        reads = engine.get_stats()["decode_attention"]
    assert got == [greedy_reference(model, p, 40) for p in shorts] + [greedy_reference(model, p, 6) for p in longs]
    assert again == alone
    assert reads["pages"] > 0, reads
