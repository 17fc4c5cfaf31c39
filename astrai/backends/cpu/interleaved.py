"""Q4_0 weights with eight rows interleaved (the kernels' ``Q4X8``), the layout one-row int4
matmuls read fastest.

In astrai/model/quantized.py's layout each row's 16-byte blocks follow one another, so a
one-row matmul keeps a sum per row and adds its lanes up at the end. Interleaved, for each
group of eight rows, block b's 128 bytes hold in their k-th 32 bytes bytes 4k..4k+3 of the
eight rows' block b, row by row: one 32-byte load feeds one integer dot-product instruction
whose eight lanes are the eight rows' sums, against four inputs of x broadcast (llama.cpp's
Q4_0x8 repack). The scales follow: block by block, the group's eight. Both tensors keep their
shape and dtype; only the order of the bytes inside each group of eight rows changes, so a
weight is re-laid in place, and a stacked weight whose members have a multiple of eight rows
each is interleaved member by member.
"""

from __future__ import annotations

import torch

GROUP = 8  # rows interleaved together
BLOCK_BYTES = 16  # a Q4_0 block's nibbles


def can_interleave(qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether (qweight, scales) are Q4_0 blocks the interleaved layout holds: a multiple of eight
    rows, one fp16 scale per 16 bytes of nibbles, each tensor's rows contiguous and back to back."""
    return (qweight.dtype == torch.uint8 and scales.dtype == torch.float16 and qweight.dim() == scales.dim() == 2
            and qweight.shape[0] == scales.shape[0] and qweight.shape[0] % GROUP == 0 and scales.shape[1] > 0
            and qweight.shape[1] == BLOCK_BYTES * scales.shape[1] and qweight.is_contiguous() and scales.is_contiguous())


def interleaved_values(qweight: torch.Tensor) -> torch.Tensor:
    """The interleaved copy of Q4_0 nibbles [out, 16 blocks]."""
    rows, width = qweight.shape
    groups = qweight.reshape(rows // GROUP, GROUP, width // BLOCK_BYTES, 4, 4)  # [group, row, block, k, byte]
    return groups.permute(0, 2, 3, 1, 4).reshape(rows, width)  # [group, block, k, row, byte]


def model_values(interleaved: torch.Tensor) -> torch.Tensor:
    """The nibbles of an interleaved weight back in quantized.py's layout."""
    rows, width = interleaved.shape
    groups = interleaved.reshape(rows // GROUP, width // BLOCK_BYTES, 4, GROUP, 4)
    return groups.permute(0, 3, 1, 2, 4).reshape(rows, width)


def interleaved_scales(scales: torch.Tensor) -> torch.Tensor:
    """The interleaved copy of Q4_0 scales [out, blocks]."""
    rows, blocks = scales.shape
    return scales.reshape(rows // GROUP, GROUP, blocks).transpose(1, 2).reshape(rows, blocks)


def model_scales(interleaved: torch.Tensor) -> torch.Tensor:
    """The scales of an interleaved weight back in quantized.py's layout."""
    rows, blocks = interleaved.shape
    return interleaved.reshape(rows // GROUP, blocks, GROUP).transpose(1, 2).reshape(rows, blocks)
