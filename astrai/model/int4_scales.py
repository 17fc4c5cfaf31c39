"""The int4 scale rule of calibrated quantization: Q4_0 blocks whose scales minimise the
importance-weighted squared error of each block (astrai/model/calibration.py measures the
importance; astrai/model/quantized.py stores the result). It sits below both so that the
quantized linear can apply the rule without importing the calibration run."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# the block's signed largest weight lands on these levels (Q4_0's rule is -8), then is refitted
CANDIDATE_LEVELS = (-9.0, -8.5, -8.0, -7.75, -7.5, -7.25, -7.0, -6.75, -6.5, -6.25, -6.0, -5.5,
                    6.0, 6.5, 7.0, 7.5)
BLOCK = 32


def quantize_int4_weighted(weight: torch.Tensor, importance: torch.Tensor,
                           chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scales) of a float [out, in] weight in Q4_0's layout (astrai.model.quantized),
    each block's scale the candidate of least importance-weighted squared error."""
    out_features, in_features = weight.shape
    if importance.shape != (in_features,):
        raise ValueError(f"importance has shape {tuple(importance.shape)}, expected ({in_features},)")
    padded = -(-in_features // BLOCK) * BLOCK
    w = F.pad(weight.detach().float(), (0, padded - in_features))
    a = importance.float().clamp_min(0)
    mean = a.mean()
    # relative to the mean, with a floor so that a channel never seen active still counts a little
    a = (a / mean if mean > 0 else torch.ones_like(a)) + 1e-6
    a = F.pad(a, (0, padded - in_features)).reshape(1, padded // BLOCK, BLOCK)
    levels, scales = [], []
    for start in range(0, out_features, chunk_rows):
        blocks = w[start:start + chunk_rows].reshape(-1, padded // BLOCK, BLOCK)
        q, d = _best_scales(blocks, a)
        levels.append(q)
        scales.append(d)
    q = (torch.cat(levels) + 8).to(torch.uint8)
    qweight = (q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)).reshape(out_features, padded // 2)
    return qweight.contiguous(), torch.cat(scales).squeeze(-1).to(torch.float16).contiguous()


def _round_to_levels(blocks: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return torch.clamp(torch.round(blocks * inverse), -8, 7)


def _best_scales(blocks: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels in [-8, 7] and fp16-exact scales [..., 1] for blocks [rows, n, 32]."""
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    best_error: Optional[torch.Tensor] = None
    for level in CANDIDATE_LEVELS:
        q = _round_to_levels(blocks, largest / level)
        norm = (a * q * q).sum(-1, keepdim=True)
        d = torch.where(norm > 0, (a * blocks * q).sum(-1, keepdim=True) / norm.clamp_min(1e-30),
                        torch.zeros_like(norm))
        d = d.to(torch.float16).float()  # the scale as stored
        q = _round_to_levels(blocks, d)
        error = (a * (blocks - q * d) ** 2).sum(-1, keepdim=True)
        if best_error is None:
            best_error, best_q, best_d = error, q, d
        else:
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_q = torch.where(better, q, best_q)
            best_d = torch.where(better, d, best_d)
    return best_q, best_d
