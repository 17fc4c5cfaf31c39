"""Speculative decoding is exact: greedy output equals decoding without it, token for token, through
every path a verify step takes (the fused C step for a lone row at every weight type, the model's
forward for a batch, MLA and MoE models); sampled output keeps the model's own distribution; and
the drafting machinery (prompt lookup, a draft model, the pause of a row whose drafts fail) does
what it says, leaking no page."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch

from astrai.backends.cpu.serving import ServingLinear
from astrai.errors import RequestError
from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.draft_model import DraftModel
from astrai.inference.head_drafter import HeadDrafter
from astrai.inference.sampling import SamplingPipeline
from astrai.inference.speculative import NgramIndex, PromptLookup, SpeculationControl, accept_greedy
from astrai.model.draft_head import DraftHead
from astrai.model.quantized import cast_linear_weights, quantize_model
from inference_helpers import greedy_reference, make_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


def repeating_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds drafts, and one that does not."""
    rng = random.Random(seed)
    base = [rng.randrange(256) for _ in range(12)]
    return [base * 3, base + base[:5], [rng.randrange(256) for _ in range(9)]]


def run(model, prompts, n: int, batch: int, **settings) -> tuple[list[list[int]], dict]:
    with InferenceEngine(model, None, max_batch_size=batch, page_size=4, num_pages=256, **settings) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=n, **GREEDY)) for p in prompts]
        tokens = [h.result(timeout=60).token_ids for h in handles]
        return tokens, engine.get_stats()


def quantized(kind: str):
    model = make_model("tiny", seed=1)
    if kind == "bf16":
        return cast_linear_weights(model, torch.bfloat16)
    return model if kind == "fp32" else quantize_model(model, kind)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4", "int4-asym"])
@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_lookup_greedy_output_is_unchanged(weights, batch):
    model = quantized(weights)
    prompts = repeating_prompts()
    expected, _ = run(model, prompts, 40, batch)
    got, stats = run(model, prompts, 40, batch, speculative="ngram")
    assert got == expected
    spec = stats["speculative"]
    assert spec["verify_steps"] > 0 and spec["accepted_tokens"] > 0  # the drafts were checked, and some kept
    assert stats["pages_used"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tiny", "tiny-mla", "tiny-moe"])
def test_every_model_family_matches_full_recomputation(kind):
    model = make_model(kind)
    prompts = repeating_prompts(1)
    expected = [greedy_reference(model, p, 24) for p in prompts]
    got, stats = run(model, prompts, 24, 2, speculative="ngram")
    assert got == expected
    assert stats["speculative"]["accepted_tokens"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch", [1, 3])
def test_draft_model_greedy_output_is_unchanged(batch):
    target = make_model("tiny")
    prompts = [[random.Random(n).randrange(256) for _ in range(n)] for n in (9, 30, 3)]
    expected = [greedy_reference(target, p, 30) for p in prompts]
    small = DraftModel(make_model("tiny", seed=5, n_layers=1), 256, 256, batch, page_size=4)
    got, stats = run(target, prompts, 30, batch, speculative="draft", drafter=small)
    assert got == expected
    assert 0 < stats["speculative"]["acceptance_rate"] < 1  # a different model: some drafts kept, some not
    assert small.cache.stats()["pages_used"] == 0  # the draft cache let go of every finished task

    itself = DraftModel(target, 256, 256, batch, page_size=4)
    got, stats = run(target, prompts, 30, batch, speculative="draft", drafter=itself, draft_tokens=5)
    assert got == expected
    assert stats["speculative"]["acceptance_rate"] == 1.0  # the target drafting for itself is always right
    assert stats["speculative"]["tokens_per_row_step"] > 4


def exact_distribution(model, prompt: list[int], pipeline: SamplingPipeline) -> torch.Tensor:
    """P(t0, t1, t2) [V, V, V] of the first three sampled tokens, from the model's own logits."""
    V = model.config.vocab_size
    with torch.no_grad():
        p0 = pipeline.apply(model(torch.tensor([prompt]))["logits"][0, -1:]).softmax(-1)[0]
        ctx1 = torch.tensor([prompt + [a] for a in range(V)])
        p1 = pipeline.apply(model(ctx1)["logits"][:, -1]).softmax(-1)  # [V, V]
        ctx2 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p2 = pipeline.apply(model(ctx2)["logits"][:, -1]).softmax(-1).view(V, V, V)
    return p0[:, None, None] * p1[:, :, None] * p2


@pytest.mark.timeout(240)
def test_sampled_output_keeps_the_models_distribution():
    """Chi-square goodness of fit of 3,000 sampled (t1, t2) pairs to the target's exact
    distribution, drafted by the target's own greedy choices (the likeliest token: kept often,
    rejected often). Keeping drafts without the rejection rule, or drawing the correction from
    the plain distribution instead of the residual, shifts mass toward the guesses far past the bound."""
    V = 12
    target = make_model("tiny", seed=2, vocab_size=V, init_std=0.3)
    draft = DraftModel(target, V, 256, 16, page_size=4)
    prompt = [1, 5, 3, 7]
    temperature, top_k = 0.9, 8
    joint = exact_distribution(target, prompt, SamplingPipeline.from_params(temperature, top_k))
    pairs = joint.sum(0).flatten()  # P(t1, t2)
    n = 3000
    counts = torch.zeros(V * V)
    with InferenceEngine(target, None, max_batch_size=16, page_size=4, num_pages=512, max_queue=n,
                         speculative="draft", drafter=draft, draft_tokens=3) as engine:
        # the batch switch's timed plain steps would pause drafting (a draft as large as its
        # target does not pay): this test wants many verify steps, not speed
        engine.scheduler._speculation.remeasure = n
        handles = [engine.submit(prompt, SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k,
                                                        ignore_eos=True, seed=i)) for i in range(n)]
        for h in handles:
            t = h.result(timeout=120).token_ids
            counts[t[1] * V + t[2]] += 1
        spec = engine.get_stats()["speculative"]
    assert spec["verify_steps"] > 50 and 0 < spec["accepted_tokens"] < spec["drafted_tokens"]
    expected = pairs * n
    keep = expected >= 5  # the usual validity rule; the rest pooled into one cell
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    wanted = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    chi2 = float(((observed - wanted) ** 2 / wanted.clamp_min(1e-9)).sum())
    dof = int(keep.sum())  # cells - 1, with the pooled cell counted
    # the 0.999 quantile of chi-square is below dof + 3.1 sqrt(2 dof) + 10 for these dof (Wilson-Hilferty)
    assert chi2 < dof + 3.1 * (2 * dof) ** 0.5 + 10, (chi2, dof)


def test_ngram_index_finds_the_latest_earlier_occurrence_never_the_suffix_itself():
    index = NgramIndex(2, 3)
    context = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    index.update(context)
    assert index.lookup(context, 3) == [7, 1, 2]  # after the latest earlier "1 2 3"
    assert NgramIndex(2, 3).lookup([4, 5, 6], 2) == []
    loop = [8, 4, 4, 4]
    index = NgramIndex(2, 4)
    index.update(loop)
    assert index.lookup(loop, 4) == [4, 4, 4, 4]  # a match one back: the loop goes on
    index.update(loop + [5, 8, 4])  # grows incrementally
    assert index.lookup(loop + [5, 8, 4], 2) == [4, 4]
    assert PromptLookup().propose([type("T", (), {"task_id": "a", "context": context})()], [0]) == [[]]


def test_accept_greedy_keeps_the_agreeing_prefix_and_the_models_token():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 4, 6, 2]):
        logits[row, best] = 1.0
    assert accept_greedy(logits, [3, 4, 5]) == [3, 4, 6]
    assert accept_greedy(logits, [3, 4, 6]) == [3, 4, 6, 2]
    assert accept_greedy(logits[:1], []) == [3]


def test_a_rows_draft_length_follows_what_it_kept():
    control = SpeculationControl("ngram", 4)
    task = type("T", (), {"task_id": "a"})()
    assert control.wanted(task, room=10) == 4
    assert control.wanted(task, room=2) == 2  # never past max_tokens or the context limit
    control.record("a", 4, 3, 4)
    assert control.wanted(task, 10) == 4  # one more than it kept
    control.record("a", 4, 1, 2)
    assert control.wanted(task, 10) == 2
    control.record("a", 2, 2, 3)
    assert control.wanted(task, 10) == 4  # every draft kept: twice as long
    control.record("a", 4, 4, 5)
    assert control.wanted(task, 10) == 4  # never past k


def test_a_row_the_drafter_finds_nothing_for_takes_growing_runs_of_steps():
    control = SpeculationControl("ngram", 4)
    assert [control.undrafted_steps("a") for _ in range(6)] == [1, 2, 4, 4, 4, 4]
    control.record("a", 2, 1, 2)  # a draft came: the next miss is a single step again
    assert [control.undrafted_steps("a") for _ in range(3)] == [1, 2, 4]
    assert control.undrafted_steps("b") == 1  # each row its own count


class _NeverDrafts:
    """A drafter with no guess, ever: prompt lookup over output that never repeats."""

    def __init__(self):
        self.asked = 0

    def propose(self, tasks, k):
        self.asked += 1
        return [[] for _ in k]

    def forget(self, task_id):
        pass


@pytest.mark.timeout(60)
def test_a_lone_greedy_row_without_drafts_decodes_in_runs_and_keeps_its_tokens():
    """Where drafting finds nothing, the row takes runs of greedy steps in one call (1, 2, then 4
    tokens per loop step), not one step per call: 40 tokens ask the drafter 11 times, not 39."""
    model = make_model("tiny", seed=2)
    prompt = [5, 9, 2, 6]
    drafter = _NeverDrafts()
    got, stats = run(model, [prompt], 40, 1, speculative="draft", drafter=drafter)
    assert got == [greedy_reference(model, prompt, 40)]
    assert drafter.asked == 11  # 1 + 2 + 4 x 9 = 39 tokens after the prefill's first
    assert stats["speculative"]["verify_steps"] == 0


def test_a_row_whose_drafts_fail_pauses_drafting():
    control = SpeculationControl("ngram", 4)
    task = type("T", (), {"task_id": "a"})()
    control.record("a", 4, 3, 4)
    control.record("a", 4, 0, 1)
    assert control.wanted(task, 10) == 1  # one failure after a good step: no pause yet, a short draft
    for _ in range(3):  # a missed one-token draft weighs a quarter of a missed four-token one
        control.record("a", 1, 0, 1)
        assert control.wanted(task, 10) == 1
    control.record("a", 1, 0, 1)
    assert [control.wanted(task, 10) for _ in range(8)] == [0] * 8  # paused for 8 steps
    assert control.wanted(task, 10) == 4  # then drafts as a new row
    for _ in range(2):
        control.record("a", 4, 0, 1)
    assert [control.wanted(task, 10) for _ in range(16)] == [0] * 16  # the second pause is twice as long
    assert control.stats()["acceptance_rate"] == 3 / 20


def test_a_batch_size_whose_verify_steps_lose_to_plain_steps_stops_drafting():
    control = SpeculationControl("ngram", 4, warmup=3)
    control.timed("decode", 1, 0.010, 1)  # 100 tokens/s plainly
    for _ in range(3):
        assert control.batch_wanted(1)
        control.timed("verify", 1, 0.030, 2.0)  # 67 tokens/s drafting
    assert [control.batch_wanted(1) for _ in range(8)] == [False] * 8  # paused for 8 steps, then measured again
    assert control.batch_wanted(1)
    for _ in range(3):
        control.timed("verify", 1, 0.030, 4.0)  # 133 tokens/s: drafting pays
        assert control.batch_wanted(1)
    assert control.batch_wanted(2)  # another batch size has its own figures
    control.timed("greedy", 1, 0.080, 8)  # a run of 8 greedy steps: 10 ms a token
    assert control.stats()["paused_steps"] == 8



def test_a_pause_earned_by_one_request_ends_when_another_takes_its_place():
    """A lone request whose drafts lost pauses drafting for its batch size while it runs; the
    next request alone in the batch drafts at once (its drafts are measured afresh, and its
    own loss starts the pauses from the shortest again)."""
    control = SpeculationControl("draft", 4, warmup=3)
    control.timed("decode", 1, 0.010, 1)  # 100 tokens/s plainly
    for _ in range(3):
        assert control.batch_wanted(1, ["a"])
        control.timed("verify", 1, 0.030, 2.0)  # "a" drafts at 67 tokens/s
    assert [control.batch_wanted(1, ["a"]) for _ in range(4)] == [False] * 4
    assert control.batch_wanted(1, ["b"])  # a new request: measured afresh
    for expected in (True, True, False):
        control.timed("verify", 1, 0.030, 2.0)
        assert control.batch_wanted(1, ["b"]) is expected
    assert [control.batch_wanted(1, ["b"]) for _ in range(7)] == [False] * 7  # an 8-step pause of its own
    assert control.batch_wanted(1, ["b"])


def test_a_batch_whose_rows_draft_every_step_still_measures_plain_steps():
    """A drafter with a guess every step leaves no plain step to weigh verify steps against:
    after ``remeasure`` verify steps in a row the batch takes one plain step, and drafting that
    loses to it stops."""
    control = SpeculationControl("draft", 4, warmup=3, remeasure=5)
    for _ in range(5):
        assert control.batch_wanted(1)
        control.timed("verify", 1, 0.030, 2.0)  # 67 tokens/s, and nothing yet to compare with
    assert not control.batch_wanted(1)  # the plain step
    control.timed("greedy", 1, 0.080, 8)  # 100 tokens/s plainly
    assert [control.batch_wanted(1) for _ in range(8)] == [False] * 8  # drafting loses: paused
    stats = control.stats()
    assert stats["plain_steps"] == 1 and stats["paused_steps"] == 8
    for _ in range(5):  # where drafting wins, one step in `remeasure` is plain
        assert control.batch_wanted(1)
        control.timed("verify", 1, 0.030, 4.0)
    assert not control.batch_wanted(1) and control.batch_wanted(1)


class WrongDrafter:
    """Always drafts a token the model would not pick (one not in the context)."""

    def __init__(self):
        self.calls = 0

    def propose(self, tasks, k):
        self.calls += 1
        return [[255] * n for n in k]

    def forget(self, task_id):
        pass


@pytest.mark.timeout(120)
def test_drafting_stops_for_a_row_when_it_does_not_pay():
    model = make_model("tiny", seed=4)
    prompt = [3, 1, 4, 1, 5]
    expected = greedy_reference(model, prompt, 60)
    assert 255 not in expected
    drafter = WrongDrafter()
    got, stats = run(model, [prompt], 60, 1, speculative="draft", drafter=drafter)
    assert got == [expected]
    assert stats["speculative"]["accepted_tokens"] == 0
    assert drafter.calls < 20  # most of the 60 steps decoded plainly after the row paused


class SlowOracle:
    """Drafts the model's own greedy continuation (every draft is kept), taking ``seconds`` a call;
    every other call finds nothing at once, so that plain steps are timed too."""

    def __init__(self, continuation: list[int], prompt_len: int, seconds: float):
        self.continuation, self.prompt_len, self.seconds = continuation, prompt_len, seconds
        self.calls = 0

    def propose(self, tasks, k):
        self.calls += 1
        if self.calls % 2:
            return [[] for _ in k]
        time.sleep(self.seconds)
        return self.continuations(tasks, k)

    def continuations(self, tasks, k):
        drafts = []
        for task, n in zip(tasks, k):
            done = task.num_computed + 1 - self.prompt_len  # outputs already in the context
            drafts.append(self.continuation[done:done + n])
        return drafts

    def forget(self, task_id):
        pass


@pytest.mark.timeout(120)
def test_a_verify_step_is_timed_with_its_drafting():
    """What the batch switch weighs against plain steps is a verify step's whole cost: a drafter's
    time (spent while the step is planned) counts with the step, even when every draft is right."""
    model = make_model("tiny", seed=4)
    prompt = [3, 1, 4, 1, 5]
    expected = greedy_reference(model, prompt, 40)
    timings = []
    with InferenceEngine(model, None, max_batch_size=1, page_size=4, num_pages=256, speculative="draft",
                         drafter=SlowOracle(expected, len(prompt), 0.2)) as engine:
        control = engine.scheduler._speculation
        timed = control.timed

        def recorded(kind, rows, seconds, tokens):
            timings.append((kind, seconds))
            timed(kind, rows, seconds, tokens)

        control.timed = recorded
        got = engine.submit(prompt, SamplingParams(max_tokens=40, **GREEDY)).result(timeout=60).token_ids
    assert got == expected
    verify = [seconds for kind, seconds in timings if kind == "verify"]
    plain = [seconds for kind, seconds in timings if kind != "verify"]
    assert verify and plain
    assert min(verify) >= 0.2 > max(plain)


class CatchingUpOracle(SlowOracle):
    """SlowOracle drafting at every call, at once, whose per-request catch-up (a draft model's
    prefill of the prompt) takes ``catch_up_seconds``."""

    def __init__(self, continuation: list[int], prompt_len: int, catch_up_seconds: float):
        super().__init__(continuation, prompt_len, 0.0)
        self.catch_up_seconds, self.caught_up = catch_up_seconds, []

    def propose(self, tasks, k):
        return self.continuations(tasks, k)

    def catch_up(self, tasks):
        for task in tasks:
            if task.task_id not in self.caught_up:
                self.caught_up.append(task.task_id)
                time.sleep(self.catch_up_seconds)


def test_a_drafters_catch_up_with_a_new_prompt_is_not_timed_as_drafting():
    """A draft model prefills a new request's prompt once; charged to the step it happens in, it
    would make drafting look slower than plain decoding and pause it."""
    model = make_model("tiny", seed=4)
    prompt = [3, 1, 4, 1, 5]
    expected = greedy_reference(model, prompt, 40)
    timings = []
    drafter = CatchingUpOracle(expected, len(prompt), 0.3)
    with InferenceEngine(model, None, max_batch_size=1, page_size=4, num_pages=256, speculative="draft",
                         drafter=drafter) as engine:
        control = engine.scheduler._speculation
        timed = control.timed
        control.timed = lambda kind, rows, seconds, tokens: (timings.append((kind, seconds)),
                                                               timed(kind, rows, seconds, tokens))
        got = engine.submit(prompt, SamplingParams(max_tokens=40, **GREEDY)).result(timeout=60).token_ids
        assert engine.get_stats()["speculative"]["paused_steps"] == 0
    assert got == expected
    assert len(drafter.caught_up) == 1
    verify = [seconds for kind, seconds in timings if kind == "verify"]
    assert verify and max(verify) < 0.3


def test_a_draft_models_catch_up_prefills_the_prompt_and_drafts_the_same():
    """``DraftModel.catch_up`` leaves the draft cache holding all but a prompt's last token, so the
    first draft feeds one token; its drafts equal those of a draft model that did not catch up."""
    target, small = make_model("tiny"), make_model("tiny", seed=5, n_layers=1)
    prompt = [random.Random(7).randrange(256) for _ in range(30)]
    task = type("T", (), {"task_id": "a", "context": prompt})()
    plain, caught = DraftModel(small, 256, 256, 1, page_size=4), DraftModel(small, 256, 256, 1, page_size=4)
    caught.catch_up([task])
    assert caught._held["a"] == (29, []) and caught.cache.stats()["pages_used"] > 0
    assert caught.propose([task], [4]) == plain.propose([task], [4])
    caught.forget("a")
    assert caught.cache.stats()["pages_used"] == 0


def test_a_draft_model_that_finds_no_pages_for_its_drafts_lets_go_and_drafts_later():
    small = make_model("tiny", seed=5, n_layers=1)
    task = type("T", (), {"task_id": "a", "context": [3, 1, 4, 1, 5]})()
    draft = DraftModel(small, 256, 256, 1, page_size=4)
    extend = draft.cache.task_extend
    draft.cache.task_extend = lambda task_id, n: False
    assert draft.propose([task], [3]) == [[]] and draft.cache.stats()["pages_used"] == 0
    draft.cache.task_extend = extend
    assert draft.propose([task], [3]) == DraftModel(small, 256, 256, 1, page_size=4).propose([task], [3])


@pytest.mark.timeout(60)
def test_bad_settings_are_refused_with_a_clear_error():
    model = make_model("tiny")
    with pytest.raises(RequestError, match="speculative must be one of ngram, draft"):
        InferenceEngine(model, None, speculative="medusa")
    with pytest.raises(RequestError, match="draft_tokens must be an integer from 1 to 7"):
        InferenceEngine(model, None, speculative="ngram", draft_tokens=8)
    with pytest.raises(RequestError, match="needs a drafter"):
        InferenceEngine(model, None, speculative="draft")
    with pytest.raises(RequestError, match="share the target's tokenizer"):
        DraftModel(make_model("tiny", vocab_size=300), 256, 256, 4)


@pytest.mark.timeout(120)
def test_an_aborted_speculating_request_leaks_no_page():
    target = make_model("tiny")
    drafter = DraftModel(target, 256, 256, 2, page_size=4)
    with InferenceEngine(target, None, max_batch_size=2, page_size=4, num_pages=128, speculative="draft",
                         drafter=drafter) as engine:
        handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=200, **GREEDY))
        events = iter(handle)
        next(events)
        next(events)
        handle.abort()
        list(events)
        assert engine.get_stats()["pages_used"] == 0
        assert drafter.cache.stats()["pages_used"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_draft_head_drafts_from_the_verify_steps_hidden_states(batch):
    """The head's drafts come from the hidden state each verify step (and a prompt's last step)
    leaves; the output is the target's whatever the head guesses (an untrained head here)."""
    target = make_model("tiny")
    prompts = repeating_prompts(2)
    expected = [greedy_reference(target, p, 30) for p in prompts]
    drafter = HeadDrafter(DraftHead.for_target(target, torch.arange(256)))
    seen = []
    observe = drafter.observe
    drafter.observe = lambda task, hidden: (seen.append((task, task.num_computed, hidden.clone())),
                                            observe(task, hidden))
    unprepared = copy.deepcopy(drafter.head)
    got, stats = run(target, prompts, 30, batch, speculative="draft", drafter=drafter)
    assert got == expected
    assert stats["speculative"]["drafted_tokens"] > 0 and stats["speculative"]["verify_steps"] > 0
    assert not drafter._state  # every finished task forgotten
    # the runner laid the head out for its kernels (the C GEMV for a draft's one row), same numbers
    assert isinstance(drafter.head.out_proj, ServingLinear) and isinstance(drafter.head.down_proj, ServingLinear)
    hidden, tokens = torch.randn(batch, target.config.dim), torch.tensor([3, 9, 27][:batch])
    with torch.no_grad():
        for a, b in zip(drafter.head(hidden, tokens), unprepared.bind(target)(hidden, tokens)):
            assert torch.allclose(a, b, atol=1e-4)
    with torch.no_grad():  # each hidden state handed over is the model's own at the last computed position
        for task, computed, hidden in seen[::3]:
            want = target(torch.tensor([task.context[:computed]]))["hidden_states"][0, -1]
            assert torch.allclose(hidden, want, atol=1e-4), (computed, (hidden - want).abs().max())


def test_a_draft_head_keeps_a_row_drafting_on_fewer_kept_tokens_than_a_draft_model():
    """A head's drafts cost about 1% of a step, so a row stops drafting only below a tenth of
    its drafts kept; a draft model's, which cost steps of a model, below three tenths."""
    target = make_model("tiny")
    with InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64, speculative="draft",
                         drafter=HeadDrafter(DraftHead.for_target(target, torch.arange(256)))) as engine:
        head_control = engine.scheduler._speculation
    with InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64, speculative="draft",
                         drafter=DraftModel(make_model("tiny", seed=5, n_layers=1), 256, 256, 1, page_size=4)) as engine:
        model_control = engine.scheduler._speculation
    assert head_control.min_kept == HeadDrafter.min_kept == 0.1 and model_control.min_kept == 0.3
    for control in (head_control, model_control):  # a row keeping a fifth of its drafts
        for i in range(12):
            control.record("a", 4, 1 if i % 5 else 0, 2)
            control.record("a", 1, 0, 1)
    assert head_control.wanted(type("T", (), {"task_id": "a"})(), 8) > 0
    assert model_control.wanted(type("T", (), {"task_id": "a"})(), 8) == 0


def test_the_head_drafter_drafts_only_from_a_current_hidden_state():
    target = make_model("tiny")
    head = DraftHead.for_target(target, torch.arange(256))
    drafter = HeadDrafter(head)
    task = type("T", (), {"task_id": "a", "context": [5, 6, 7, 8], "num_computed": 3})()
    assert drafter.propose([task], [3]) == [[]] and not drafter.ready(task)
    hidden = torch.randn(target.config.dim)
    drafter.observe(task, hidden)
    assert drafter.propose([task], [3]) == [head.draft(hidden, 8, 3)]  # from context[num_computed], the next input
    task.num_computed = 4  # a plain step ran since: the state is stale
    assert not drafter.ready(task) and drafter.propose([task], [3]) == [[]]


class _NeverReady:
    """A drafter that never holds a hidden state: every decode step is a verify step without drafts."""

    def propose(self, tasks, k):
        return [[] for _ in tasks]

    def ready(self, task):
        return False

    def observe(self, task, hidden):
        pass

    def forget(self, task_id):
        pass


@pytest.mark.timeout(120)
def test_a_verify_step_without_drafts_is_timed_as_a_plain_step():
    """What drafting gains is judged by the verify steps that carried drafts: the steps a draft
    head takes to fetch its first hidden state count as plain decode steps (counted as verify
    steps, they would pull the measure down and pause drafting for the whole batch)."""
    target = make_model("tiny")
    with InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64, speculative="draft",
                         drafter=_NeverReady()) as engine:
        tokens = engine.submit(repeating_prompts(3)[0], SamplingParams(max_tokens=12, **GREEDY)).result(timeout=60)
        times = engine.scheduler._speculation._times[1]
        assert len(tokens.token_ids) == 12 and engine.get_stats()["speculative"]["verify_steps"] >= 10
    assert times.verify_s is None and times.verifies == 0 and times.decode_s is not None


class FailingDrafter:
    """Drafts once, then raises, as a draft model out of memory would."""

    def __init__(self):
        self.calls = 0

    def propose(self, tasks, k):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("drafter out of memory")
        return [[] for _ in k]

    def forget(self, task_id):
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch", [1, 2])
def test_a_drafter_that_fails_is_dropped_and_decoding_goes_on(batch):
    model = make_model("tiny", seed=5)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]][:batch]
    expected = [greedy_reference(model, p, 30) for p in prompts]
    drafter = FailingDrafter()
    got, stats = run(model, prompts, 30, batch, speculative="draft", drafter=drafter)
    assert got == expected
    assert drafter.calls == 2  # never asked again after it raised
    assert stats["speculative"]["stopped"] == "RuntimeError: drafter out of memory"
    assert stats["pages_used"] == 0
