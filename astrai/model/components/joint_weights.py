"""Linears that read the same input, stacked in one weight buffer.

Attention's q/k/v projections and the MLP's gate/up all multiply the same input. A
module names such groups with ``joint_linears()``; the inference engine stacks each
group's weights in one buffer (astrai/inference/weight_layout.py), every weight a view
of its block of rows, and ``linear_group`` (layers.py) then runs the group as one
product over the joint weight found here.
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
    """The [sum of outs, in] view covering ``weights`` when they are stacked in one buffer
    (each weight a contiguous block of its rows, in order); otherwise None. The answer is
    kept per group (so that the view keeps its identity, which its packed copy is found
    by) until a weight's address or layout changes."""
    layout = tuple((w.data_ptr(), w.stride(), w.shape, w.dtype) for w in weights)
    entry = _joints.get(weights[0])
    if entry is not None and entry[0] == layout:
        return entry[1]
    joint = _stacked(weights)
    _joints[weights[0]] = (layout, joint)
    return joint


def _stacked(weights: list[torch.Tensor]) -> Optional[torch.Tensor]:
    first = weights[0]
    if first.dim() != 2 or first.shape[1] == 0:
        return None
    n_in = first.shape[1]
    offset = 0
    for weight in weights:
        if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
                or weight.shape[1] != n_in or not weight.is_contiguous()
                or weight.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or weight.storage_offset() != first.storage_offset() + offset):
            return None
        offset += weight.numel()
    return first.detach().as_strided((offset // n_in, n_in), (n_in, 1))
