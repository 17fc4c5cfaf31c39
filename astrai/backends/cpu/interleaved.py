"""Q4_0 and Q8_0 weights with eight rows interleaved (the kernels' ``Q4X8`` and ``Q8X8``), the
layout the few-row quantized matmuls read fastest.

In astrai/model/quantized.py's layout each row's blocks follow one another, so a one-row
matmul keeps a sum per row and adds its lanes up at the end, and each more row of x costs
that work again. Interleaved, for each group of eight rows, block b's bytes hold in their
k-th 32 bytes bytes 4k..4k+3 of the eight rows' block b, row by row (Q4_0: 4 such loads of
nibbles a block; Q8_0: 8 loads of bytes): one 32-byte load feeds one integer dot-product
instruction whose eight lanes are the eight rows' sums, against four inputs of x broadcast
(llama.cpp's Q4_0x8 repack). Q8_0's bytes are stored as w + 128 (w ^ 0x80), the unsigned
operand that instruction takes. The scales follow: block by block, the group's eight. Both
tensors keep their shape and dtype; only the order (and for Q8_0 the top bit) of the bytes
inside each group of eight rows changes, so a weight is re-laid in place, and a stacked
weight whose members have a multiple of eight rows each is interleaved member by member.
"""

from __future__ import annotations

import torch

GROUP = 8  # rows interleaved together
BLOCK = 32  # weights per block: 16 bytes of Q4_0 nibbles, 32 of Q8_0 values


def _block_bytes(values: torch.Tensor) -> int:
    return BLOCK // 2 if values.dtype == torch.uint8 else BLOCK


def can_interleave(values: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether (values, scales) are Q4_0 (uint8 nibbles) or Q8_0 (int8) blocks the interleaved
    layout holds: a multiple of eight rows, one fp16 scale per block, each tensor's rows
    contiguous and back to back."""
    return (values.dtype in (torch.uint8, torch.int8) and scales.dtype == torch.float16
            and values.dim() == scales.dim() == 2 and values.shape[0] == scales.shape[0]
            and values.shape[0] % GROUP == 0 and scales.shape[1] > 0
            and values.shape[1] == _block_bytes(values) * scales.shape[1]
            and values.is_contiguous() and scales.is_contiguous())


def _flip(values: torch.Tensor) -> torch.Tensor:
    """int8 values with their top bit flipped (w <-> w + 128 as unsigned bytes); uint8 as they are."""
    return (values.view(torch.uint8) ^ 0x80).view(torch.int8) if values.dtype == torch.int8 else values


def interleaved_values(values: torch.Tensor) -> torch.Tensor:
    """The interleaved copy of Q4_0 nibbles [out, 16 blocks] or Q8_0 values [out, 32 blocks]."""
    rows, width = values.shape
    fours = _block_bytes(values) // 4
    groups = values.reshape(rows // GROUP, GROUP, width // (4 * fours), fours, 4)  # [group, row, block, k, byte]
    return _flip(groups.permute(0, 2, 3, 1, 4).reshape(rows, width))  # [group, block, k, row, byte]


def model_values(interleaved: torch.Tensor) -> torch.Tensor:
    """The values of an interleaved weight back in quantized.py's layout."""
    rows, width = interleaved.shape
    fours = _block_bytes(interleaved) // 4
    groups = _flip(interleaved).reshape(rows // GROUP, width // (4 * fours), fours, GROUP, 4)
    return groups.permute(0, 3, 1, 2, 4).reshape(rows, width)


def interleaved_scales(scales: torch.Tensor) -> torch.Tensor:
    """The interleaved copy of the scales [out, blocks]."""
    rows, blocks = scales.shape
    return scales.reshape(rows // GROUP, GROUP, blocks).transpose(1, 2).reshape(rows, blocks)


def model_scales(interleaved: torch.Tensor) -> torch.Tensor:
    """The scales of an interleaved weight back in quantized.py's layout."""
    rows, blocks = interleaved.shape
    return interleaved.reshape(rows // GROUP, blocks, GROUP).transpose(1, 2).reshape(rows, blocks)
