"""A lone greedy row's verify steps and a draft head's drafts in one C call (the CPU runner's
``speculative_run``, native/decode_step.c's ``astrai_head_speculative_steps``): greedy decoding's
tokens, the same drafts, acceptances and pauses as the steps taken one by one through Python,
and the end of a run at a stop token."""

from __future__ import annotations

import random
from typing import Optional, Sequence

import pytest
import torch

from astrai.backends.cpu.kernels import kernels_available, ngram_drafts
from astrai.backends.cpu.runner import CpuModelRunner
from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.head_drafter import HeadDrafter
from astrai.inference.speculative import NgramIndex, SpeculationControl
from astrai.model.draft_head import DraftHead
from astrai.model.quantized import cast_linear_weights, quantize_model
from inference_helpers import greedy_reference, make_model

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

PROMPT = [3, 1, 4, 1, 5, 2, 6]


def copy_head(target, shift: int = 0) -> DraftHead:
    """A head that drafts the token it is given (``shift`` 0) or the one ``shift`` after it: its
    fuse takes the token's embedding alone, its MLP adds nothing and its output rows are the
    embedding's, so the token scores highest against itself. On a target whose greedy output
    repeats a token for a while, a copying head's drafts are kept there and rejected where the
    output moves on; a shifted head's are always rejected."""
    vocab, dim = target.config.vocab_size, target.config.dim
    ids = (torch.arange(vocab) + shift) % vocab
    head = DraftHead.for_target(target, ids)
    with torch.no_grad():
        head.fuse.weight.zero_()
        head.fuse.weight[:, dim:] = torch.eye(dim)
        head.down_proj.weight.zero_()
        head.out_proj.weight.copy_(target.embed_tokens.weight)
    return head


def constant_head(target, token: int) -> DraftHead:
    """A head that drafts ``token`` every time: its output rows are all zero, so every score
    ties and the first row, ``token``'s, is the argmax."""
    vocab = target.config.vocab_size
    head = DraftHead.for_target(target, torch.tensor([token, *(t for t in range(vocab) if t != token)]))
    with torch.no_grad():
        head.out_proj.weight.zero_()
    return head


def decode(target, head: Optional[DraftHead], params: SamplingParams, runs: bool, monkeypatch,
           prompt: Sequence[int] = PROMPT) -> tuple[list[int], list, dict]:
    """The tokens, each verify step's (drafted, kept, row paused after it), and how many runs (their
    tokens, and each step's drafts made and kept) and single verify steps the runner took, with runs of verify steps allowed or
    not. The batch switch is held on (its decisions follow the machine's timing) and runs end only
    at their token budget, so both ways take the same decisions at the same tokens. Without
    ``head`` the rows draft by prompt lookup."""
    steps, counts = [], {"runs": 0, "verify": 0, "run_tokens": 0, "run_steps": []}
    record, speculative_run, verify = SpeculationControl.record, CpuModelRunner.speculative_run, CpuModelRunner.verify

    def recorded(self, task_id, drafted, kept, produced):
        record(self, task_id, drafted, kept, produced)
        steps.append((drafted, kept, self._rows[task_id].paused > 0))

    def run_counted(self, *args):
        run = speculative_run(self, *args)
        counts["runs"] += 1
        if run is not None:
            counts["run_tokens"] += len(run.tokens)
            counts["run_steps"] += list(zip(run.drafted, run.kept_drafts))
        return run

    def verify_counted(self, *args):
        counts["verify"] += 1
        return verify(self, *args)

    monkeypatch.setattr(SpeculationControl, "record", recorded)
    monkeypatch.setattr(SpeculationControl, "batch_wanted", lambda self, rows, task_ids=(): True)
    monkeypatch.setattr(CpuModelRunner, "speculative_run", run_counted)
    monkeypatch.setattr(CpuModelRunner, "verify", verify_counted)
    drafting = {"speculative": "ngram"} if head is None else {"speculative": "draft", "drafter": HeadDrafter(head)}
    with InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64, greedy_run_steps=64,
                         greedy_run_seconds=float("inf"), **drafting) as engine:
        if not runs:
            engine.scheduler._runner.runs_speculative = False  # a verify step at a time
        tokens = engine.submit(list(prompt), params).result(60).token_ids
    monkeypatch.undo()
    return tokens, steps, counts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("shift", [0, 1])
def test_a_run_of_verify_steps_drafts_keeps_and_pauses_as_single_steps_do(weights, shift, monkeypatch):
    target = make_model("tiny", seed=3)
    head = copy_head(target, shift)
    if weights == "bf16":
        target = cast_linear_weights(target, torch.bfloat16)
    elif weights != "fp32":  # the head's argmax per row through each weight type's matmul
        target = quantize_model(target, weights)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    with InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64) as plain:
        expected = plain.submit(PROMPT, params).result(60).token_ids
    got, steps, counts = decode(target, head, params, True, monkeypatch)
    single, single_steps, single_counts = decode(target, head, params, False, monkeypatch)
    assert got == single == expected
    # the same drafts and acceptances (a row back from plain decoding takes its first step one by
    # one as a verify step without drafts, to fetch the head's state; in a run, a plain step)
    assert steps == [s for s in single_steps if s[0]]
    assert counts["runs"] > 0 and counts["verify"] == 0 and single_counts["runs"] == 0
    # the first verify step drafts, from the state the prompt's step left (in a run and one by one)
    assert counts["run_steps"][0][0] > 0 and single_steps[0][0] > 0
    if shift == 0:  # drafts kept whole; over fp32 weights the output moves on in a draft's middle
        assert any(kept == drafted > 1 for drafted, kept, _ in steps)
        assert weights != "fp32" or any(0 < kept < drafted for drafted, kept, _ in steps)
    else:  # every draft rejected: the row's kept fraction falls below the floor, and it pauses
        assert all(kept == 0 for _, kept, _ in steps) and any(paused for _, _, paused in steps)


@pytest.mark.timeout(120)
def test_a_run_ends_at_a_stop_token_inside_its_kept_drafts(monkeypatch):
    target = make_model("tiny", seed=3)
    expected = greedy_reference(target, PROMPT, 40)
    stop = expected[12]
    assert stop not in expected[:12]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    got, steps, counts = decode(target, constant_head(target, stop), params, True, monkeypatch)
    assert got == expected[:13]
    assert counts["runs"] > 0 and counts["verify"] == 0
    assert steps[-1][:2] == (1, 1)  # the stop token was a kept draft,
    assert counts["run_tokens"] == 12  # and the run gave no token after it (the first came from the prompt's step)


@pytest.mark.timeout(120)
def test_a_request_aborted_between_runs_leaks_no_page():
    target = make_model("tiny", seed=3)
    with InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64, speculative="draft",
                         drafter=HeadDrafter(copy_head(target)), greedy_run_steps=2) as engine:
        handle = engine.submit(PROMPT, SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
        events = iter(handle)
        for _ in range(3):
            next(events)
        handle.abort()
        list(events)
        stats = engine.get_stats()
        assert stats["pages_used"] == 0 and stats["speculative"]["verify_steps"] > 0
        assert not engine.scheduler._drafter._state


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_a_run_of_verify_steps_drafts_by_prompt_lookup_as_the_lookup_in_python_does(weights, monkeypatch):
    """Prompt lookup's drafts made in C between a run's verify steps: greedy decoding's tokens,
    and at every step that drafted, the drafts Python's lookup makes over the same tokens
    (checked through what the step kept and where it stopped keeping)."""
    target = make_model("tiny", seed=0)
    if weights == "int8":
        target = quantize_model(target, "int8")
    rng = random.Random(2)
    prompt = [rng.randrange(256) for _ in range(10)] * 3  # the output repeats a token, then moves to another
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64) as plain:
        expected = plain.submit(prompt, params).result(60).token_ids
    got, steps, counts = decode(target, None, params, True, monkeypatch, prompt)
    assert got == expected
    assert counts["runs"] > 0 and counts["verify"] == 0
    assert any(kept > 0 for _, kept, _ in steps) and any(kept < drafted for drafted, kept, _ in steps)
    context, out = list(prompt) + expected[:1], expected[1:]  # the first token comes from the prompt's step
    for drafted, kept in counts["run_steps"]:
        if drafted:
            index = NgramIndex(3, 4)
            index.update(context)
            guess = index.lookup(context, drafted)
            assert guess[:kept] == out[:kept] and (kept == drafted or guess[kept] != out[kept])
        context, out = context + out[:kept + 1], out[kept + 1:]
    assert not out


def test_prompt_lookups_drafts_in_c_are_pythons():
    """The C lookup a run drafts with, on random contexts over a few tokens (many repeats, some
    nearer the end than the draft is long), against speculative.py's index."""
    rng = random.Random(0)
    for _ in range(400):
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        min_n = rng.randrange(1, 4)
        max_n, k = min_n + rng.randrange(0, 3), rng.randrange(1, 8)
        index = NgramIndex(min_n, max_n)
        index.update(context)
        assert ngram_drafts(context, min_n, max_n, k) == index.lookup(context, k), (context, min_n, max_n, k)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("runs", [True, False])
def test_a_request_aborted_while_its_verify_step_runs_leaves_no_drafting_state(runs, monkeypatch):
    """The abort frees the request's pages and forgets its drafting at once, while the step still
    runs; what the step hands back afterwards must not bring the records back (they would stay
    for the engine's life)."""
    target = make_model("tiny", seed=3)
    drafter = HeadDrafter(copy_head(target))
    engine = InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64, speculative="draft",
                             drafter=drafter, greedy_run_steps=8 if runs else 1)
    name = "speculative_run" if runs else "verify"
    real = getattr(CpuModelRunner, name)

    def aborting(self, *args):
        result = real(self, *args)
        for task_id in list(engine.scheduler._task_mgr.tasks):
            engine.scheduler.remove_task(task_id)
        return result

    monkeypatch.setattr(CpuModelRunner, name, aborting)
    with engine:
        result = engine.submit(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)).result(60)
        assert result.finish_reason == "abort"
        assert engine.get_stats()["pages_used"] == 0
        assert not drafter._state and not engine.scheduler._speculation._rows
