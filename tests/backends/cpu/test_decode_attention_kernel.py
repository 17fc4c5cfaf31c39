"""The C decode attention kernel: built here, equal to plain attention, used by the engine's
decode steps, refusing what it cannot read safely; and the batched-matmul fallback."""

from __future__ import annotations

import logging
import os
import random
import shutil

import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.backends.cpu import attention, kernels as native_kernels
from astrai.backends.cpu.kernels import decode_attention, kernels_available
from inference_helpers import greedy_reference, make_model


def _reference(q, k, v, lens, scale):
    """Softmax attention of each row's query heads over its first lens[b] positions, in float64."""
    B, _, H, _ = q.shape
    group = H // k.shape[2]
    out = []
    for b in range(B):
        n = int(lens[b])
        keys = k[b, :n].double().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v[b, :n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b, 0].double(), keys) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(out).unsqueeze(1).float()


def test_the_kernel_builds_on_this_machine():
    # CI machines have a C compiler; without one the engine falls back (tested below), but the
    # kernel's own correctness must be checked somewhere, so this must not silently skip
    assert kernels_available()


# the general loop's shapes, then each copy compiled for a fixed shape (width 64: 1, 2, 4 heads per
# group; width 128: 1, 2), then one beside them (3 heads per group) that takes the general loop
@pytest.mark.parametrize("heads,kv_heads,width,v_width", [
    (4, 2, 16, 16), (4, 4, 8, 8), (8, 2, 32, 16), (2, 1, 5, 3),
    (2, 2, 64, 64), (4, 2, 64, 64), (8, 2, 64, 64), (2, 2, 128, 128), (4, 2, 128, 128), (6, 2, 64, 64)])
def test_kernel_equals_attention_over_each_rows_own_context(heads, kv_heads, width, v_width):
    torch.manual_seed(heads * 100 + width)
    rows, capacity = 6, 40
    lens = torch.tensor([1, 17, 33, 8, 33, 2])
    # heads-first buffers with spare capacity, viewed as [rows, positions, heads, width]
    k_buf = torch.randn(rows + 2, kv_heads, capacity, width)
    v_buf = torch.randn(rows + 2, kv_heads, capacity, v_width)
    S = int(lens.max())
    k, v = k_buf[:rows, :, :S].transpose(1, 2), v_buf[:rows, :, :S].transpose(1, 2)
    k_buf[:rows, :, S:] = float("nan")  # never read: past every row's context
    for b, n in enumerate(lens.tolist()):
        k_buf[b, :, n:] = float("nan")  # nor past this row's own
        v_buf[b, :, n:] = float("nan")
    q = torch.randn(rows, 1, heads, width)
    got = decode_attention(q, k, v, lens, 0.3)
    assert got.shape == (rows, 1, heads, v_width)
    assert torch.allclose(got, _reference(q, k, v, lens, 0.3), atol=1e-5)


def test_kernel_matches_the_batched_matmuls_it_replaces():
    torch.manual_seed(0)
    rows, kv_heads, group, width, capacity = 5, 2, 2, 16, 64
    lens = torch.tensor([30, 4, 50, 50, 1])
    S = int(lens.max())
    k = torch.randn(rows, kv_heads, capacity, width)[:, :, :S].transpose(1, 2)
    v = torch.randn(rows, kv_heads, capacity, width)[:, :, :S].transpose(1, 2)
    q = torch.randn(rows, 1, kv_heads * group, width)
    mask = torch.zeros(rows, 1, 1, S).masked_fill_(torch.arange(S).view(1, 1, 1, S) >= lens.view(rows, 1, 1, 1),
                                                  float("-inf"))
    want = attention.attend_one_query(q, k, v, mask)
    assert torch.allclose(decode_attention(q, k, v, lens, width ** -0.5), want, atol=1e-5)


def test_kernel_refuses_lengths_and_layouts_it_cannot_read():
    q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 2, 10, 8).transpose(1, 2), torch.randn(2, 2, 10, 8).transpose(1, 2)
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(q, k, v, torch.tensor([3, 11]), 1.0)  # past the buffers' 10 positions
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(q, k, v, torch.tensor([0, 3]), 1.0)
    with pytest.raises(ValueError, match="layout or dtype"):
        decode_attention(q.double(), k.double(), v.double(), torch.tensor([3, 3]), 1.0)
    with pytest.raises(ValueError, match="layout or dtype"):
        decode_attention(q, k, v, torch.tensor([3, 3], dtype=torch.int32), 1.0)


def _engine_outputs(kind):
    model = make_model(kind)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    expected = [greedy_reference(model, p, 10) for p in prompts]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, None, max_batch_size=6, page_size=4, num_pages=128, prefill_chunk_size=24) as engine:
        got = [h.result(timeout=60).token_ids for h in [engine.submit(p, params) for p in prompts]]
    return got, expected


def test_engine_decode_steps_run_the_kernel(monkeypatch):
    calls = []
    real = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k))
    got, expected = _engine_outputs("tiny")
    assert got == expected
    assert calls and max(calls) > 1  # batched decode steps of several rows


def test_without_the_kernel_decode_falls_back_to_batched_matmuls(monkeypatch):
    monkeypatch.setenv("ASTRAI_FUSED_DECODE", "0")  # its one-row steps run the kernel inside C
    monkeypatch.setattr(attention, "kernels_available", lambda: False)
    monkeypatch.setattr(attention, "decode_attention", lambda *a: pytest.fail("kernel called"))
    got, expected = _engine_outputs("tiny")
    assert got == expected


def test_no_compiler_or_switched_off_means_no_kernel_and_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ASTRAI_CACHE", str(tmp_path))
    monkeypatch.setenv("ASTRAI_NATIVE_KERNELS", "0")
    assert native_kernels._library.__wrapped__() is None
    monkeypatch.delenv("ASTRAI_NATIVE_KERNELS")
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger="astrai.backends.cpu.kernels"):
        assert native_kernels._library.__wrapped__() is None
    assert "could not build astrai's decode kernels" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.skipif(not native_kernels.kernels_available(), reason="needs a C compiler (CI has one)")
def test_a_new_build_prunes_all_but_the_latest_older_builds(monkeypatch, tmp_path):
    """Each source change builds a library under a new name; building one keeps the newest
    few others (other checkouts may share the cache) and deletes the rest."""
    monkeypatch.setenv("ASTRAI_CACHE", str(tmp_path))
    folder = tmp_path / "astrai" / "kernels"
    folder.mkdir(parents=True)
    stale = [folder / f"astrai-kernels-{i:016x}.so" for i in range(native_kernels.KEEP_BUILDS + 3)]
    for age, path in enumerate(stale):
        path.write_bytes(b"old")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))  # stale[0] the most recent
    unrelated = folder / "notes.txt"
    unrelated.write_text("kept")
    built = native_kernels._build(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"),
                                  native_kernels.PORTABLE)
    assert built.is_file() and built not in stale
    left = sorted(folder.glob("astrai-kernels-*.so"))
    assert left == sorted([built, *stale[:native_kernels.KEEP_BUILDS]])
    assert unrelated.read_text() == "kept"
