"""The CPU attention backend's paths (astrai/backends/cpu/attention.py) equal plain masked
attention over the whole context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.backends.cpu.attention import attend_one_query, attend_shared_prefix
from astrai.model.components.attention import attend


def _reference(q, k, v, mask):
    """Masked softmax attention written out, K/V heads repeated for grouped queries."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_shared_prefix_split_equals_attention_over_the_whole_context(heads, kv_heads):
    torch.manual_seed(0)
    B, T, P, S, D = 3, 5, 8, 7, 16
    q = torch.randn(B, T, heads, D)
    k_shared, v_shared = torch.randn(P, kv_heads, D), torch.randn(P, kv_heads, D)
    k, v = torch.randn(B, S, kv_heads, D), torch.randn(B, S, kv_heads, D)
    # rows with 5, 3 and 1 real new tokens, padding queries repeat the last real position,
    # keys past each row's end are padding: the mask of a real cache view
    n_new = [5, 3, 1]
    start = [P + 2, P + 4, P + 6]
    positions = torch.tensor([[s + min(t, n - 1) for t in range(T)] for s, n in zip(start, n_new)])
    key_pos = torch.arange(P, P + S)
    suffix_mask = (key_pos.view(1, 1, S) <= positions.unsqueeze(2)).unsqueeze(1)  # [B, 1, T, S]
    full_k = torch.cat((k_shared.expand(B, P, kv_heads, D), k), dim=1)
    full_v = torch.cat((v_shared.expand(B, P, kv_heads, D), v), dim=1)
    full_mask = torch.cat((torch.ones(B, 1, T, P, dtype=torch.bool), suffix_mask), dim=-1)
    got = attend_shared_prefix(q, (k_shared, v_shared), (k, v), suffix_mask)
    torch.testing.assert_close(got, _reference(q, full_k, full_v, full_mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, attend(q, full_k, full_v, full_mask), rtol=1e-5, atol=1e-5)


def test_one_query_path_reads_heads_first_buffers_like_sdpa():
    torch.manual_seed(1)
    B, H, Hkv, S, D, capacity = 3, 4, 2, 9, 8, 16
    q = torch.randn(B, 1, H, D)
    k_buf, v_buf = torch.randn(B, Hkv, capacity, D), torch.randn(B, Hkv, capacity, D)
    k, v = k_buf[:, :, :S].transpose(1, 2), v_buf[:, :, :S].transpose(1, 2)  # [B, S, Hkv, D] views
    lengths = torch.tensor([9, 4, 6])
    mask = (torch.arange(S).view(1, 1, 1, S) < lengths.view(B, 1, 1, 1))
    got = attend_one_query(q, k, v, mask)
    torch.testing.assert_close(got, _reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_additive_mask_masks_like_the_boolean_one_on_every_path():
    """Decode views carry their mask as 0 / -inf to add (cheaper than masked_fill_); the
    one-query path and SDPA (bf16 queries with the fp32 mask included) must read it as the
    boolean mask."""
    torch.manual_seed(2)
    B, H, Hkv, S, D, capacity = 3, 4, 2, 9, 8, 16
    q = torch.randn(B, 1, H, D)
    k_buf, v_buf = torch.randn(B, Hkv, capacity, D), torch.randn(B, Hkv, capacity, D)
    k, v = k_buf[:, :, :S].transpose(1, 2), v_buf[:, :, :S].transpose(1, 2)
    mask = torch.arange(S).view(1, 1, 1, S) < torch.tensor([9, 4, 6]).view(B, 1, 1, 1)
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    want = _reference(q, k, v, mask)
    torch.testing.assert_close(attend_one_query(q, k, v, additive), want, rtol=1e-5, atol=1e-5)
    dense_k, dense_v = k.contiguous(), v.contiguous()  # not heads-first: the SDPA path
    torch.testing.assert_close(attend(q, dense_k, dense_v, additive), want, rtol=1e-5, atol=1e-5)
    low = attend(q.bfloat16(), dense_k.bfloat16(), dense_v.bfloat16(), additive)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("own_pages, cascade", [(1, True), (6, False)])
def test_a_shared_prefix_takes_cascade_attention_only_while_it_is_most_of_the_context(own_pages, cascade):
    """Two prompt rows continue contexts that begin with the same two cached pages: behind one
    page of their own the prefix is most of the context (cascade attention), behind six it
    is not, and the rows attend packed, one at a time. Either way the result is the plain view's."""
    from astrai.backends.cpu.attention import CpuKvcacheView
    from astrai.inference.cache import KvcacheView, Storage

    torch.manual_seed(0)
    ps, heads, kv_heads, D, n = 4, 4, 2, 8, 3
    storage = Storage(1, 32, ps, ((kv_heads, D), (kv_heads, D)))
    storage.k_cache.normal_()
    storage.v_cache.normal_()
    rows = [[0, 1] + [2 + b * 8 + i for i in range(own_pages + 1)] for b in range(2)]
    table = torch.tensor(rows)
    start = [(2 + own_pages) * ps] * 2
    q, k, v = torch.randn(2, n, heads, D), torch.randn(2, n, kv_heads, D), torch.randn(2, n, kv_heads, D)
    view = CpuKvcacheView(storage, table, start, [n, n], packed=True)
    assert (view.shared_len, view.packed) == ((2 * ps, False) if cascade else (0, True))
    got = view.attend(0, q.reshape(1, 2 * n, heads, D) if view.packed else q,
                      k.reshape(1, 2 * n, kv_heads, D) if view.packed else k,
                      v.reshape(1, 2 * n, kv_heads, D) if view.packed else v)
    expected = KvcacheView(storage, table, start, [n, n]).attend(0, q, k, v)
    torch.testing.assert_close(got.reshape(2, n, heads, D), expected, atol=1e-5, rtol=1e-5)
