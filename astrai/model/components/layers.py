"""The basic layers: RMSNorm, Linear, Embedding and RotaryEmbedding (with scaling)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 for stability."""

    def __init__(self, dim: int, norm_eps: float = 1e-6):
        super().__init__()
        self.norm_eps = norm_eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _RMSNormFunction.apply(x, weight, self.norm_eps)
        if x.dtype == weight.dtype == torch.float32:  # no casts to make
            return _rms_norm(x, weight, self.norm_eps)[0]
        return _rms_norm(x.float(), weight.float(), self.norm_eps)[0].to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) * weight, 1 / rms(x)) for fp32 ``x``. The mean is written as a sum and a
    division, which is how PyTorch computes it on CPU (the same bits), minus one dispatch."""
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps))
    return (x * rstd).mul_(weight), rstd


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with a hand-written backward: autograd's graph of the composite norm
    (pow, mean, rsqrt, two products, a weight gradient reduced over every token) keeps
    several activation-sized intermediates and runs many small kernels; this one saves
    only x and 1/rms.

    With y = x̂·w and x̂ = x·r (r = 1/rms): dL/dw = Σ g·x̂ and
    dL/dx = r·(g·w − x̂·mean(g·w·x̂)).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_norm(x.float(), weight.float(), eps)
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        grad = grad.float()
        grad_x_hat = grad * weight.float()
        grad_x = (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True)).mul_(rstd)
        grad_weight = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class Linear(nn.Linear):
    """``nn.Linear`` without a bias unless asked (the usual LLM convention)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kwargs):
        super().__init__(in_features, out_features, bias=bias, **kwargs)


def select_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The positions ``index`` of each row of ``x`` [B, T, ...]: ``index`` [B] gives one
    position a row ([B, 1, ...]), ``index`` [B, R] gives R ([B, R, ...])."""
    rows = torch.arange(x.shape[0], device=x.device)
    if index.dim() == 2:
        return x[rows.unsqueeze(1), index]
    return x[rows, index].unsqueeze(1)


class Embedding(nn.Embedding):
    """Token embedding table (kept as its own name so init and weight tying can find it)."""


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding``'s (cos, sin) [B, T, D] in the form ``apply_rotary`` takes, made once
    per forward: [B, T, 1, D] in the activations' dtype, with the sign of the half
    rotation [x1, x2] → [−x2, x1] folded into sin's first half, so each application is a
    flip and two products instead of a negation, a concatenation and casts (it runs
    twice per layer)."""
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(2).to(dtype), sin.unsqueeze(2).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by the tables of ``rotary_tables``: x·cos + [−x2, x1]·sin.

    The half-split layout (first half real, second half imaginary) is the one the
    Llama/Qwen checkpoints use, so imported weights need no permutation.
    """
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]; the signs live in sin
    return torch.addcmul(x * cos, swapped, sin)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, base: float, scaling: Optional[dict], max_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for RoPE and the attention scale factor that yarn adds.

    Scaling types: ``linear`` (positions divided by factor), ``ntk`` (base enlarged by
    factor^(d/(d-2))), ``llama3`` (wavelength-banded interpolation) and ``yarn``
    (ramped mix of interpolation and extrapolation plus an attention temperature).
    The formulas match transformers' ``modeling_rope_utils`` so imported checkpoints
    keep their logits (tests/model/test_model_hf_parity.py checks this).
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    kind = (scaling or {}).get("type")
    factor = float((scaling or {}).get("factor", 1.0))
    if kind == "ntk":
        base = base * factor ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    attention_scale = 1.0
    if kind == "linear":
        inv_freq = inv_freq / factor
    elif kind == "llama3":
        original = scaling.get("original_max_len", max_len)
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        low_wavelen = original / low_freq_factor
        high_wavelen = original / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / factor, torch.where(wavelen < high_wavelen, inv_freq, blended))
    elif kind == "yarn":
        original = scaling.get("original_max_len", max_len)
        beta_fast = scaling.get("beta_fast", 32.0)
        beta_slow = scaling.get("beta_slow", 1.0)
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_scale = scaling.get("attention_factor") or (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim else _yarn_mscale(factor)
        )

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation_weight = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq, float(attention_scale)


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) [B, T, dim] for arbitrary ``position_ids``.

    Angles are computed from position ids on every call rather than read from a
    table, so positions beyond ``max_len`` and packed sequences with reset positions
    need no special handling.
    """

    def __init__(self, dim: int, max_len: int, base: float = 10000.0, scaling: Optional[dict] = None):
        super().__init__()
        self.dim, self.max_len, self.base, self.scaling = dim, max_len, base, scaling
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.attention_scale = 1.0
        self.reset_buffers()

    def reset_buffers(self) -> None:
        inv_freq, self.attention_scale = rope_inv_freq(self.dim, self.base, self.scaling, self.max_len)
        with torch.no_grad():
            self.inv_freq = inv_freq.to(self.inv_freq.device) if self.inv_freq.device.type != "meta" else inv_freq

    def _apply(self, fn, recurse: bool = True):
        """Keep the frequencies in fp32 when the model is cast (``model.to(torch.bfloat16)``):
        bf16 frequencies would be off by whole radians a few hundred positions in."""
        result = super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.reset_buffers()
        return result

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(x.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.attention_scale, angles.sin() * self.attention_scale
