"""The hand-written pieces of the layers against autograd through the plain formulas."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.model.components.layers import RMSNorm, apply_rotary, rotary_tables


def test_rmsnorm_backward_matches_autograd_of_the_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, norm_eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16, requires_grad=True)
    grad = torch.randn(3, 5, 16)
    want = F.rms_norm(x, (16,), norm.weight, 1e-5)
    want_x, want_w = torch.autograd.grad(want, (x, norm.weight), grad)
    got = norm(x)
    got_x, got_w = torch.autograd.grad(got, (x, norm.weight), grad)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got_w, want_w)
    with torch.no_grad():  # the inference path gives the same values
        torch.testing.assert_close(norm(x), want)


def test_rotary_tables_rotate_like_the_half_split_formula():
    torch.manual_seed(1)
    x = torch.randn(2, 4, 3, 8)
    angles = torch.randn(2, 4, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    want = x * cos.unsqueeze(2) + rotate_half * sin.unsqueeze(2)
    torch.testing.assert_close(apply_rotary(x, *rotary_tables(cos, sin, x.dtype)), want)
