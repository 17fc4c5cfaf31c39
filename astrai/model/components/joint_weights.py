"""Linears that read the same input, laid side by side in one weight buffer.

Attention's q/k/v projections and the MLP's gate/up all multiply the same input. A
module names such groups with ``joint_linears()``; the inference engine lays each
group's weights side by side in one column-major buffer (astrai/inference/
weight_layout.py), every weight a view of its block of columns, and ``linear_group``
(layers.py) then runs the group as one product over the joint weight found here.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


def joint_groups(model: nn.Module) -> Iterator[tuple[nn.Module, ...]]:
    """Every group of linears that ``model``'s modules name with ``joint_linears()``."""
    for module in model.modules():
        joint_linears = getattr(module, "joint_linears", None)
        if callable(joint_linears):
            yield from joint_linears()


_joints: WeakIdKeyDictionary = WeakIdKeyDictionary()  # first weight -> (layout of the group, joint view or None)


def joint_weight(weights: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The [sum of outs, in] column-major view covering ``weights`` when they lie side by side
    in one buffer ([in, total] row-major, each weight a block of its columns, in order);
    otherwise None. The answer is kept per group (so that the view keeps its identity,
    which its packed copy is found by) until a weight's address or layout changes."""
    layout = tuple((w.data_ptr(), w.stride(), w.shape, w.dtype) for w in weights)
    entry = _joints.get(weights[0])
    if entry is not None and entry[0] == layout:
        return entry[1]
    joint = _side_by_side(weights)
    _joints[weights[0]] = (layout, joint)
    return joint


def _side_by_side(weights: list[torch.Tensor]) -> Optional[torch.Tensor]:
    first = weights[0]
    if first.dim() != 2:
        return None
    n_in, ld = first.shape[1], first.stride(1)
    offset = 0
    for weight in weights:
        if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
                or weight.stride() != (1, ld) or weight.shape[1] != n_in
                or weight.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or weight.storage_offset() != first.storage_offset() + offset):
            return None
        offset += weight.shape[0]
    if offset != ld:
        return None
    return first.detach().as_strided((ld, n_in), (1, ld))
