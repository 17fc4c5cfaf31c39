"""Decode after a long context (astrai/backends/cpu/native/decode_attention.c, decode_buffers.py,
the 16-bit KV cache): the kernel, split along the context among the threads, equals plain
attention over dense rows and over contexts read in place through page lists; 16-bit K/V are
read as their widened values; a long context stays on the fast decode paths (past the decode
buffers' budget its attention reads the page store in place, never a gathered copy) and gives
the tokens of full recomputation through every path; and a 16-bit cache's logits stay within
a stated tolerance of the fp32 cache's."""

from __future__ import annotations

import random

import pytest
import torch

from astrai.backends.cpu import attention
from astrai.backends.cpu.kernels import decode_attention, kernels_available, kv_kind, paged_decode_attention
from astrai.errors import RequestError
from astrai.inference import InferenceEngine, SamplingParams
from inference_helpers import greedy_reference, make_model

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

CONTEXT = 2000  # positions already cached when decoding starts
NEW = 6


@pytest.fixture
def two_threads():
    """Two threads, so a single row's attention is split along its context."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _reference(q, k, v, lens, scale):
    """Softmax attention of each row's query heads over its first lens[b] positions, in float64
    over the K/V values as stored (16-bit ones widened exactly)."""
    B, _, H, _ = q.shape
    group = H // k.shape[2]
    out = []
    for b in range(B):
        n = int(lens[b])
        keys = k[b, :n].double().repeat_interleave(group, dim=1)
        values = v[b, :n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b, 0].double(), keys) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(out).unsqueeze(1).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,width", [(9, 3, 64), (4, 2, 16), (6, 2, 64), (3, 1, 5)])
@pytest.mark.parametrize("lens", [[1], [2], [1999], [700, 3]])
def test_the_kernel_split_along_the_context_equals_attention(two_threads, dtype, heads, kv_heads, width, lens):
    """One row on two threads (and two rows on three) take the split: every stretch's maximum,
    sum and partial output combined give the softmax over the whole context, also for a
    context shorter than the team (an empty stretch)."""
    torch.manual_seed(len(lens) * 1000 + lens[0] + heads)
    if len(lens) > 1:
        torch.set_num_threads(3)
    rows, capacity = len(lens), max(lens) + 9
    k_buf = torch.randn(rows, kv_heads, capacity, width).to(dtype)
    v_buf = torch.randn(rows, kv_heads, capacity, width).to(dtype)
    for b, n in enumerate(lens):  # past a row's own context: never read
        k_buf[b, :, n:] = float("nan")
        v_buf[b, :, n:] = float("nan")
    S = max(lens)
    k, v = k_buf[:, :, :S].transpose(1, 2), v_buf[:, :, :S].transpose(1, 2)
    q = torch.randn(rows, 1, heads, width)
    lens_t = torch.tensor(lens)
    for _ in range(2):  # a second call finds the per-pair counts reset by the first
        got = decode_attention(q, k, v, lens_t, 0.3)
        assert torch.allclose(got, _reference(q, k, v, lens_t, 0.3), atol=2e-5)


def test_rows_at_least_threads_split_like_one_row(two_threads):
    torch.manual_seed(1)
    lens = torch.tensor([40, 3, 17])
    k = torch.randn(3, 2, 40, 16).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(3, 2, 40, 16).to(torch.bfloat16).transpose(1, 2)
    q = torch.randn(3, 1, 4, 16)
    assert torch.allclose(decode_attention(q, k, v, lens, 0.25), _reference(q, k, v, lens, 0.25), atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,width", [(9, 3, 64), (4, 1, 128), (10, 2, 24)])
@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_paged_kernel_reads_each_context_where_its_pages_lie(dtype, heads, kv_heads, width, page_size, threads):
    """Rows whose positions lie on pages scattered over a store (a shared first page, as a
    prefix cache makes, and pages in no order) attend as plain attention over the same values
    laid out densely: page boundaries inside a thread's stretch, a last page partly used, a
    one-token row, and a row's table longer than its context all read the right positions."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens = [1, 37, 300, page_size]
        width_pages = -(-max(lens) // page_size) + 1
        store_pages = 4 * width_pages + 1
        order = torch.randperm(store_pages - 1)[: 4 * width_pages].view(4, width_pages) + 1
        order[:, 0] = 0  # every row's first page is the same one
        k_store = torch.randn(store_pages * page_size, kv_heads, width).to(dtype)
        v_store = torch.randn(store_pages * page_size, kv_heads, width).to(dtype)
        q = torch.randn(len(lens), 1, heads, width)
        positions = torch.arange(width_pages * page_size)
        slots = order[:, positions // page_size] * page_size + positions % page_size
        lens_t = torch.tensor(lens)
        got = paged_decode_attention(q, k_store, v_store, lens_t, order.contiguous(), page_size, 0.2)
        want = _reference(q, k_store[slots], v_store[slots], lens_t, 0.2)
        assert torch.allclose(got, want, atol=2e-5)
    finally:
        torch.set_num_threads(before)


def _engine(model, **settings):
    settings = dict(dict(max_batch_size=4, page_size=16, max_seq_len=CONTEXT + 64, prefill_chunk_size=512), **settings)
    return InferenceEngine(model, None, **settings)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(CONTEXT - 5 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def long_model():
    model = make_model("tiny", max_len=CONTEXT + 64)
    prompts = _prompts(3)
    return model, prompts, [greedy_reference(model, p, NEW) for p in prompts]


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["fused", "row_kernels", "torch"])
def test_a_long_context_decodes_the_plain_models_tokens_on_its_path(long_model, monkeypatch, two_threads, path,
                                                                     kv_cache_dtype):
    """A single request after 2,000 cached tokens gives the tokens of full recomputation (with
    an fp32 cache, and with a bf16 one on this model), and every one of its decode steps ran
    the path asked for. The decode buffers' budget is set so
    that a rounded-up group of rows would not fit (a long context once fell back to gathering
    its whole context from the pages every step)."""
    model, prompts, expected = long_model
    if path != "fused":
        monkeypatch.setenv("ASTRAI_FUSED_DECODE", "0")
    if path == "torch":
        monkeypatch.setattr(attention, "kernels_available", lambda: False)
        monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: pytest.fail("kernel called"))
    with _engine(model, max_batch_size=1, kv_cache_dtype=kv_cache_dtype) as engine:
        buffers = engine.scheduler._runner.decode_buffers
        buffers._budget = 2 * 3 * (CONTEXT + 300) * engine.scheduler.page_cache.storage.bytes_per_token()
        got = engine.submit(prompts[0], GREEDY).result(timeout=120).token_ids
        paths = engine.get_stats()["decode_paths"]
    assert got == expected[0]
    assert buffers.rows == 1
    ran = "row_kernels" if path == "torch" else path  # the matmuls still take the C kernels
    assert paths[ran] == NEW - 1 and sum(paths.values()) == NEW - 1


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_long_contexts_decode_as_a_batch(long_model, two_threads, kv_cache_dtype):
    """Three long contexts decoding together (rows >= threads: whole pairs per thread) give
    each its own plain tokens, through the batched decode view."""
    model, prompts, expected = long_model
    with _engine(model, prefill_chunk_size=3 * CONTEXT, kv_cache_dtype=kv_cache_dtype) as engine:  # one prefill step for all three
        handles = [engine.submit(p, GREEDY) for p in prompts]
        got = [h.result(timeout=120).token_ids for h in handles]
        paths = engine.get_stats()["decode_paths"]
        reads = engine.get_stats()["decode_attention"]
    assert got == expected
    assert paths["torch"] == 0 and paths["row_kernels"] + paths["batched"] > 0, paths
    # every decode step read the buffers ("pages" counts prefill steps a decoding row rode along)
    assert reads["buffers"] == sum(paths.values()) and reads["gathered"] == 0, reads


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_long_contexts_past_the_buffers_budget_read_the_pages_in_place(long_model, two_threads, kv_cache_dtype):
    """With the decode buffers' budget too small for the batch (many long chats), every decode
    step's attention reads the page store in place: each row still gets its own plain tokens,
    and no step gathers a copy of the contexts."""
    model, prompts, expected = long_model
    with _engine(model, prefill_chunk_size=3 * CONTEXT, kv_cache_dtype=kv_cache_dtype) as engine:
        engine.scheduler._runner.decode_buffers._budget = 0
        handles = [engine.submit(p, GREEDY) for p in prompts]
        got = [h.result(timeout=120).token_ids for h in handles]
        paths, reads = engine.get_stats()["decode_paths"], engine.get_stats()["decode_attention"]
    assert got == expected
    assert reads["pages"] >= sum(paths.values()) > 0 and reads["buffers"] == reads["gathered"] == 0, reads


def _decode_logprobs(model, prompt, kv_cache_dtype, fused: bool, monkeypatch):
    """The tokens, each step's five largest log-probabilities and the K cache afterwards."""
    monkeypatch.setenv("ASTRAI_FUSED_DECODE", "1" if fused else "0")
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
    with _engine(model, max_batch_size=1, kv_cache_dtype=kv_cache_dtype) as engine:
        assert engine.scheduler.page_cache.storage.k_cache.dtype == getattr(torch, kv_cache_dtype)
        result = engine.submit(prompt, params).result(timeout=120)
        keys = engine.scheduler.page_cache.storage.k_cache.float()
    tops = torch.tensor([[logprob for _, _, logprob in entry.top] for entry in result.logprobs])
    return result.token_ids, tops, keys


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_cache_stays_close_to_the_fp32_cache(long_model, monkeypatch, two_threads, kv_cache_dtype):
    """Tolerance: the five largest log-probabilities of every step within 0.01 of the fp32
    cache's for bf16 (8 bits of mantissa: a K/V element is off by up to 0.4%; measured 1.3e-3
    here) and within 1e-3 for fp16 (11 bits; measured 6e-5). The fused C step, which rounds
    K/V itself, and the model's forward, where torch rounds them, agree to float rounding."""
    model, prompts, expected = long_model
    tokens32, tops32, _ = _decode_logprobs(model, prompts[0], "float32", True, monkeypatch)
    fused, tops_fused, keys_fused = _decode_logprobs(model, prompts[0], kv_cache_dtype, True, monkeypatch)
    plain, tops_plain, keys_plain = _decode_logprobs(model, prompts[0], kv_cache_dtype, False, monkeypatch)
    assert tokens32 == expected[0] == fused == plain
    tolerance = 0.01 if kv_cache_dtype == "bfloat16" else 1e-3
    assert (tops_fused - tops32).abs().max() < tolerance
    assert 0 < (tops_fused - tops32).abs().max()  # the cache is 16-bit indeed
    assert torch.allclose(tops_fused, tops_plain, atol=1e-4)
    # the decode steps' keys as the C step rounded them and as torch did: the same values but
    # where the fp32 keys themselves differ in their last bits and fall on either side of a tie
    differ = keys_fused != keys_plain
    assert differ.float().mean() < 1e-3 and torch.allclose(keys_fused, keys_plain, rtol=1e-2)


@pytest.mark.parametrize("bad", ["int8", "fp16", "float64", torch.int8, 16])
def test_a_bad_kv_cache_dtype_is_refused_with_the_accepted_names(bad):
    with pytest.raises(RequestError, match="kv_cache_dtype must be one of float32, bfloat16, float16"):
        InferenceEngine(make_model("tiny"), None, kv_cache_dtype=bad)


def test_the_kernels_read_every_cache_dtype():
    assert [kv_kind(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [0, 1, 2]
    assert kv_kind(torch.float64) is None
