"""The fused one-row decode step (astrai/backends/cpu/fused_decode.py, native/decode_step.c):
it serves a single request's decode steps of a plain GQA + SwiGLU model, gives the tokens of
full recomputation and the log-probabilities of the model's own forward, writes K/V that
later requests reuse through the prefix cache, follows weights changed after the engine
started, and stands aside for every model or step it does not handle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from astrai.inference import InferenceEngine, SamplingParams
from astrai.backends.cpu import fused_decode as fused_module
from astrai.backends.cpu.fused_decode import FusedDecode
from astrai.backends.cpu.kernels import kernels_available
from astrai.backends.cpu.runner import CpuModelRunner
from astrai.backends.cpu.serving import prepare_for_serving
from astrai.inference.cache import KVCache
from astrai.model.lora import LoraConfig, inject_lora
from inference_helpers import greedy_reference, make_model, with_uneven_norms

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture
def fused_calls(monkeypatch):
    """The steps that ran through the C step, one entry each (their input token), whether one
    call ran them one at a time or several."""
    calls = []
    real_step, real_steps = fused_module.decode_step, fused_module.decode_steps

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real_step(*args, **kwargs)

    def counting_runs(plan, token, *args, **kwargs):
        tokens = real_steps(plan, token, *args, **kwargs)
        calls.extend([token] + tokens[:-1])
        return tokens

    monkeypatch.setattr(fused_module, "decode_step", counting)
    monkeypatch.setattr(fused_module, "decode_steps", counting_runs)
    return calls


def with_random_biases(model):
    """``model`` with its biases (q/k/v's, where it has them) drawn at random: zero biases
    left out of a matmul would change nothing."""
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(".bias"):
                weight.uniform_(-0.5, 0.5)
    return model


def _run(model, prompts, params=GREEDY, **engine_args):
    settings = dict(max_batch_size=1, page_size=4, num_pages=96, **engine_args)
    with InferenceEngine(model, None, **settings) as engine:
        return [engine.submit(p, params).result(timeout=60) for p in prompts]


@pytest.mark.parametrize("shape", [dict(), dict(n_heads=4, n_kv_heads=1), dict(n_heads=6, n_kv_heads=3, dim=96),
                                   dict(head_dim=32, n_heads=2, n_kv_heads=2), dict(tie_weight=False),
                                   dict(attn_bias=True), dict(use_qk_norm=True)])
def test_single_request_matches_recomputation_and_the_unfused_forward(shape, fused_calls, monkeypatch):
    """Greedy tokens equal full recomputation; per-token log-probabilities equal those of the
    model's own forward (the fused step switched off) to float rounding; and every decode step
    after the first (whose context is still gathered from the pages) took the C step."""
    model = with_random_biases(with_uneven_norms(make_model("tiny", **shape)))
    prompts = [[5, 9, 200, 3], [17] * 11, [1]]
    fused = _run(model, prompts)
    steps = len(fused_calls)
    # the prefill gives the first token; a one-token prompt's prefill is itself a one-row step
    assert steps == sum(GREEDY.max_tokens - 1 + (len(p) == 1) for p in prompts)
    monkeypatch.setenv("ASTRAI_FUSED_DECODE", "0")
    plain = _run(model, prompts)
    assert len(fused_calls) == steps  # no more: switched off
    for prompt, a, b in zip(prompts, fused, plain):
        assert a.token_ids == b.token_ids == greedy_reference(model, prompt, GREEDY.max_tokens)
        ours = torch.tensor([entry.logprob for entry in a.logprobs])
        theirs = torch.tensor([entry.logprob for entry in b.logprobs])
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_steps_argmax_gives_way_to_penalties_and_sampling(fused_calls, monkeypatch):
    """The C step's argmax of the logits is the token only for a plain greedy request: with a
    repetition penalty the penalised logits decide, and a sampled request draws (the same seed
    drawing the same tokens as the unfused forward)."""
    model = make_model("tiny")
    prompt = [[5, 9, 200, 3, 5, 9]]
    penalised = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    sampled = SamplingParams(max_tokens=14, temperature=0.9, seed=3, ignore_eos=True)
    fused = [_run(model, prompt, params)[0].token_ids for params in (penalised, sampled)]
    assert len(fused_calls) == 2 * 13
    monkeypatch.setenv("ASTRAI_FUSED_DECODE", "0")
    plain = [_run(model, prompt, params)[0].token_ids for params in (penalised, sampled)]
    assert fused == plain
    assert fused[0] != _run(model, prompt)[0].token_ids[:14]  # the penalty changed the greedy tokens


def test_decode_buffers_grown_mid_request_are_followed(fused_calls):
    """A request outgrowing the decode buffers' capacity (256 tokens of headroom) gets new
    buffers mid-run: the kernel's table is rebuilt for them, so later steps write and read
    the new memory, and the tokens and log-probabilities still equal a plain forward's."""
    model = make_model("tiny", max_len=512)
    prompt = [9, 4, 1]
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, logprobs=True)
    with InferenceEngine(model, None, max_batch_size=1, page_size=4, num_pages=96) as engine:
        result = engine.submit(prompt, params).result(timeout=120)
        generations = engine.scheduler._runner.decode_buffers.generation
    assert generations >= 2  # made once, grown at least once
    assert len(fused_calls) == params.max_tokens - 1
    assert result.token_ids == greedy_reference(model, prompt, params.max_tokens)
    got = torch.tensor([entry.logprob for entry in result.logprobs])
    assert torch.allclose(got, _reference_logprobs(model, prompt, result.token_ids), atol=1e-4, rtol=1e-4)


def test_steps_past_the_decode_buffers_budget_take_the_model_forward(fused_calls):
    """With no room for decode buffers, ``decode_target`` says None and every step gathers
    its context from the pages through the model's forward, with the same tokens."""
    model = make_model("tiny")
    prompt = [2, 7, 1, 8, 2, 8]
    with InferenceEngine(model, None, max_batch_size=1, page_size=4, num_pages=96) as engine:
        engine.scheduler._runner.decode_buffers._budget = 0
        got = engine.submit(prompt, GREEDY).result(timeout=60).token_ids
    assert not fused_calls
    assert got == greedy_reference(model, prompt, GREEDY.max_tokens)
    runner = _runner(model)
    runner.decode_buffers._budget = 0
    assert runner.cache.task_alloc("a", prompt) and runner.decode_target("a", len(prompt)) is None


def _runner(model) -> CpuModelRunner:
    """A CPU runner serving ``model`` itself, over a small cache of its own."""
    return CpuModelRunner(model, KVCache.for_model(model, num_pages=8, page_size=4), in_place=True)


def _reference_logprobs(model, prompt, tokens):
    """Log-probabilities of ``tokens`` following ``prompt``, from one plain forward of the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))["logits"][0, len(prompt) - 1:-1]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def test_kv_written_by_fused_steps_serves_a_later_request_through_the_prefix_cache(fused_calls):
    """Request B's prompt is request A's prompt and output: its prefix pages, whose K/V A's
    fused decode steps wrote, are reused, and B's tokens and log-probabilities still equal
    those of a plain forward over the whole sequence."""
    model = make_model("tiny")
    with InferenceEngine(model, None, max_batch_size=1, page_size=4, num_pages=96) as engine:
        first = engine.submit([7, 8, 9], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)).result(timeout=60)
        second_prompt = [7, 8, 9] + first.token_ids[:16]
        second = engine.submit(second_prompt, GREEDY).result(timeout=60)
        assert engine.get_stats()["prefix_hit_rate"] > 0
    assert len(fused_calls) >= 18
    assert second.token_ids == greedy_reference(model, second_prompt, GREEDY.max_tokens)
    got = torch.tensor([entry.logprob for entry in second.logprobs])
    assert torch.allclose(got, _reference_logprobs(model, second_prompt, second.token_ids), atol=1e-4, rtol=1e-4)


def test_weights_changed_after_the_engine_started_are_followed(fused_calls, monkeypatch):
    """With the caller's consent to serve its model in place: new values copied in (same
    memory), then a weight replaced by a new tensor (new memory: the table is rebuilt, once,
    not at every step): both show in the next request's tokens."""
    builds = []
    real_table = fused_module._weight_table
    monkeypatch.setattr(fused_module, "_weight_table", lambda m: builds.append(1) or real_table(m))
    model = make_model("tiny")
    other = make_model("tiny", seed=3)
    prompt = [4, 40, 44]
    with InferenceEngine(model, None, max_batch_size=1, page_size=4, num_pages=96, prefix_cache=False,
                         in_place=True) as engine:
        engine.submit(prompt, GREEDY).result(timeout=60)
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters()):
                p.copy_(q)
        got = engine.submit(prompt, GREEDY).result(timeout=60).token_ids
        assert got == greedy_reference(other, prompt, GREEDY.max_tokens)
        down = model.layers[0].mlp.down
        down.weight.data = (down.weight.data * -1.0).contiguous()  # new memory, still row-major
        steps = len(fused_calls)
        got = engine.submit(prompt, GREEDY).result(timeout=60).token_ids
        assert len(fused_calls) > steps  # the C step, reading the new weight
        assert len(builds) == 2  # at the start, and once after the change
        assert got == greedy_reference(model, prompt, GREEDY.max_tokens)
        up = model.layers[1].mlp.up
        up.weight.data = (up.weight.data * -1.0).contiguous()  # gate/up no longer stacked: not the kernel's layout
        steps = len(fused_calls)
        got = engine.submit(prompt, GREEDY).result(timeout=60).token_ids
        assert len(fused_calls) == steps  # the model's own forward ran
        assert len(builds) == 3
        assert got == greedy_reference(model, prompt, GREEDY.max_tokens)


def test_a_requests_later_steps_reuse_the_check_and_a_swap_mid_request_frees_no_memory_read(monkeypatch):
    """ready() checks the model when a request's steps begin; the same request's later steps
    reuse the yes. A weight swapped for new memory in between keeps its old memory alive (the
    table holds it) until the next request rebuilds the table; ``recheck`` (loading weights)
    makes the next step check at once."""
    builds = []
    real_table = fused_module._weight_table
    monkeypatch.setattr(fused_module, "_weight_table", lambda m: builds.append(1) or real_table(m))
    model = make_model("tiny")
    prepare_for_serving(model)
    fused = FusedDecode.for_model(model)
    assert fused is not None and len(builds) == 1
    assert fused.ready("a")
    down = model.layers[0].mlp.down
    old = down.weight.data_ptr()
    down.weight.data = (down.weight.data * -1.0).contiguous()  # new memory; the old tensor's last owner is gone
    assert fused.ready("a") and len(builds) == 1  # the request's later step: no check, no rebuild
    assert old in [t.data_ptr() for t in fused._held]  # what the table still points to stays allocated
    assert fused.ready("b") and len(builds) == 2  # the next request checks and rebuilds
    assert old not in [t.data_ptr() for t in fused._held]
    assert down.weight.data_ptr() in [t.data_ptr() for t in fused._held]
    down.weight.data = (down.weight.data * -1.0).contiguous()
    fused.recheck()
    assert fused.ready("b") and len(builds) == 3  # weights loaded: checked at the very next step


def test_a_hook_or_a_swapped_in_lora_layer_sends_steps_back_to_the_model(fused_calls):
    prompt = [3, 1, 4, 1, 5]
    with InferenceEngine(make_model("tiny"), None, max_batch_size=1, page_size=4, num_pages=96,
                         prefix_cache=False) as engine:
        model = engine.model  # the engine's own copy, changed as a user with access to it might
        seen = []
        handle = model.layers[1].mlp.register_forward_hook(lambda *args: seen.append(1))
        engine.submit(prompt, GREEDY).result(timeout=60)
        handle.remove()
        assert len(seen) == GREEDY.max_tokens and not fused_calls  # every step ran the module, hook and all
        inject_lora(model, LoraConfig(rank=2, targets=["q_proj"]))
        nn.init.normal_(model.layers[0].attention.q_proj.lora_B)  # make the adapter matter
        got = engine.submit(prompt, GREEDY).result(timeout=60).token_ids
        assert not fused_calls
        assert got == greedy_reference(model, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("kind,overrides", [("tiny-mla", {}), ("tiny-moe", {}), ("tiny", dict(use_gated_attention=True))])
def test_models_of_other_shapes_are_not_fused(kind, overrides):
    model = make_model(kind, **overrides)
    prepare_for_serving(model)
    assert FusedDecode.for_model(model) is None


def test_plain_model_is_fused_only_once_laid_out_in_fp32():
    model = make_model("tiny")
    assert FusedDecode.for_model(model) is None  # q/k/v and gate/up apart: not the kernel's layout
    prepare_for_serving(model)
    assert FusedDecode.for_model(model) is not None
    assert FusedDecode.for_model(make_model("tiny").to(torch.bfloat16)) is None


def test_out_of_range_token_or_position_never_reaches_the_kernel(monkeypatch):
    """A token outside the vocabulary or a position past the buffers goes back to the model's
    forward (which reports it) rather than to C, which would read or write out of bounds."""
    from dataclasses import replace

    runner = _runner(make_model("tiny"))
    fused = runner.fused_decode
    assert runner.cache.task_alloc("a", [1, 2, 3, 4, 5])
    target = runner.decode_target("a", 3)
    assert runner.decode_target("aborted meanwhile", 3) is None  # the usual view sends its writes to the sink page
    reached = []
    monkeypatch.setattr(fused_module, "decode_step", lambda *args: reached.append(args[1]) or (torch.zeros(256), 0))
    assert fused.ready()
    for token, pos, capacity in ((256, 3, 16), (-1, 3, 16), (5, 16, 16), (5, -1, 16)):
        assert fused(token, replace(target, pos=pos, capacity=capacity)) is None
    assert not reached
    assert fused(5, replace(target, pos=3, capacity=16)) is not None and reached == [5]  # the stub stands in for C here


def test_the_plan_follows_torchs_thread_count():
    """The C step's scratch memory holds one slice per thread, so a plan made for one thread
    count is made again when torch's changes. The same count gives the same logits bit for
    bit; another count moves them by rounding only (attention splits each context among the
    threads and adds up their stretches, so the sums' order follows the thread count)."""
    runner = _runner(make_model("tiny"))
    fused = runner.fused_decode
    assert runner.cache.task_alloc("a", [1, 2, 3, 4, 5])
    before = torch.get_num_threads()
    answers = []
    try:
        for threads in (1, 3, 1):
            torch.set_num_threads(threads)
            assert fused.ready()
            logits, best = fused(5, runner.decode_target("a", 4))
            assert fused._plan.threads == threads
            assert best == int(logits.argmax())
            answers.append(logits)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(answers[0], answers[2])
    torch.testing.assert_close(answers[1], answers[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_verify_steps_rows_equal_one_row_steps_bit_for_bit(threads):
    """Each row of a verify step has the logits of a one-row step at its position, bit for bit,
    whichever thread of the team did the row's norms, rotation and SiLU: greedy speculation
    keeps plain decoding's tokens."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = _runner(make_model("tiny"))
        fused = runner.fused_decode
        assert runner.cache.task_alloc("a", list(range(1, 17)))
        tokens = [5, 9, 7, 3, 8]
        for token, pos in zip([1, 2, 3, 4], range(4)):  # a context for the rows to attend to
            assert fused(token, runner.decode_target("a", pos)) is not None
        assert fused.ready("a")
        logits, hidden = fused.verify(tokens, runner.decode_target("a", 4, len(tokens)))
        assert hidden.shape == (len(tokens), runner.model.config.dim)
        for i, token in enumerate(tokens):
            one, _ = fused(token, runner.decode_target("a", 4 + i))
            assert torch.equal(logits[i], one[0]), f"row {i}"
    finally:
        torch.set_num_threads(before)


def test_runs_on_more_threads_than_cores_beside_a_busy_process_give_the_one_thread_tokens():
    """With more threads than cores and another process spinning, team members wait at the C
    step's barriers past their spin and sleep (native/decode_step.c's team_barrier): every
    wait must still end, and the tokens and logits are those of one thread."""
    import os
    import subprocess
    import sys

    answers = []
    before = torch.get_num_threads()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for threads in (1, 3 * (os.cpu_count() or 1)):
            torch.set_num_threads(threads)
            runner = _runner(make_model("tiny"))
            assert runner.cache.task_alloc("a", list(range(1, 25)))
            assert runner.fused_decode.ready()
            tokens = runner.fused_decode.greedy_steps(5, runner.decode_target("a", 4, steps=20), stop_ids=[])
            answers.append((tokens, runner.fused_decode._plan.threads))
    finally:
        hog.kill()
        hog.wait()
        torch.set_num_threads(before)
    (one, _), (many, team) = answers
    assert len(one) == 20 and many == one and team > 1
