"""Where the engine puts fp32 linear weights for decoding on CPU.

A single request's decode step multiplies one row by every weight matrix, so its speed
is how fast the one-row products stream the weights from memory. Two things about the
weights' memory help, and the engine arranges both once, when it is made:

- Linears that read the same input (attention's q/k/v, the MLP's gate/up, as a module
  names them with ``joint_linears()``) are stacked in one buffer [total out, in], each
  weight a view of its block of rows, so that ``linear_group`` (layers.py) reads the
  group as one product: one longer stream per thread instead of two or three short ones.
- Buffers of 2 MiB or more sit in memory advised for 2 MiB pages (astrai/huge_pages.py),
  which a one-row decode streamed 3-5% faster.

The weights stay row-major, ``nn.Linear``'s own [out, in]: the C one-row product
(native/row_product.c) reads one weight row per output, one stream per thread. Earlier
versions stored them column-major ([in, out] rows) instead, which suited the BLAS and a
kernel that read eight rows at a time; timed standalone at the VM's faster bandwidth
level, that kernel read 46 GB/s where the row-major one read 50-61 and a plain sum 60-61
(at the slower level all three read alike). Row-major is also the layout every other
path expects, so models outside the engine get the kernel too.

Values never change, and neither do the parameters' identity, shape or ties
(``load_state_dict`` copies into them, keeping the layout); no memory is added beyond
one matrix's (or one group's) copy at a time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from astrai.huge_pages import HUGE_PAGE_BYTES, huge_page_empty, huge_pages_available
from astrai.model.components.joint_weights import joint_groups, joint_weight

_laid: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a single (ungrouped) weight -> the address it was moved to


def lay_out_linears(model: nn.Module) -> int:
    """Stack ``model``'s groups of fp32 CPU linears and move its large fp32 CPU linear
    weights into huge-page memory; returns how many weights moved.

    A weight shared by several modules (a tied embedding and LM head) moves once. A
    weight already where this puts it is left alone, so calling this again returns 0.
    """
    moved = 0
    seen: set[int] = set()
    with torch.no_grad():
        for group in joint_groups(model):
            moved += _stack(group, seen)
        for module in model.modules():
            if not isinstance(module, nn.Linear):
                continue
            weight = module.weight
            if id(weight) in seen or not _movable(weight):
                continue
            seen.add(id(weight))
            if _laid.get(weight) == weight.data_ptr() or weight.nbytes < HUGE_PAGE_BYTES or not huge_pages_available():
                continue
            laid = huge_page_empty(tuple(weight.shape))
            laid.copy_(weight.data)
            weight.data = laid
            _laid[weight] = laid.data_ptr()
            moved += 1
    return moved


def _movable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def _stack(group: tuple[nn.Linear, ...], seen: set[int]) -> int:
    """Copy the group's weights into one [total, in] buffer, each ``.data`` becoming its block of rows."""
    weights = [m.weight for m in group]
    if (len(weights) < 2 or any(id(w) in seen for w in weights) or len({id(w) for w in weights}) < len(weights)
            or not all(_movable(w) for w in weights) or len({w.shape[1] for w in weights}) > 1):
        return 0
    seen.update(id(w) for w in weights)
    if joint_weight(weights) is not None:  # already stacked
        return 0
    buffer = huge_page_empty((sum(w.shape[0] for w in weights), weights[0].shape[1]))
    start = 0
    for weight in weights:
        block = buffer[start:start + weight.shape[0]]
        block.copy_(weight.data)
        weight.data = block
        start += weight.shape[0]
    return len(weights)
