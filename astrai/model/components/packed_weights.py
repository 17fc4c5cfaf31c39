"""fp32 linear weights packed once for oneDNN's products on CPU, for inference.

PyTorch sends an fp32 ``F.linear`` on CPU to the MKL BLAS. On the AMD EPYC machine
this project is measured on, MKL ran the products of a few to a few hundred rows -
decode steps of a batch, prefill chunks - at 90-160 GFLOP/s, while oneDNN's linear
over a weight packed in advance into its own blocked layout ran them at 150-210
(2 threads; sums over a layer's weights plus the vocabulary projection):

=====================  ==========  ==========  ===========
weight set, rows        today       packed      speed-up
=====================  ==========  ==========  ===========
``tiny``, 8 rows        0.75 ms     0.29 ms     2.6x
``tiny``, 32 rows       1.47 ms     0.94 ms     1.6x
``tiny``, 512 rows      20.7 ms     13.5 ms     1.5x
``small``, 512 rows     126 ms      104 ms      1.2x
125M, 8 rows            9.8 ms      4.4 ms      2.2x
125M, 1 row             3.5 ms      5.1 ms      0.7x
=====================  ==========  ==========  ===========

("today" is the product the model ran before: the two-half split below 64 rows, the
plain ``F.linear`` above.) One row stays on the plain weight, which the C one-row
product (native_kernels.py) streams faster than oneDNN's one-row path.

The packed copy is extra memory (as much as the fp32 weights), made by the inference
engine only, and only read when autograd is off. A weight changed after packing (an
optimizer step, ``load_state_dict``, a new tensor assigned to ``.data``) is noticed by
its version counter and storage address and packed again before its next product, so
training the model between generations stays correct.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from astrai.model.components.joint_weights import joint_groups, joint_weight

_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (version, data_ptr, packed copy)


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed fp32 linear (x86 builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linears(model: nn.Module) -> int:
    """Pack every fp32 CPU ``nn.Linear`` weight of ``model`` for oneDNN; returns how many.

    A weight shared by several modules (a tied embedding and head) is packed once. A
    group of linears laid side by side (joint_weights.py) is packed as its joint weight,
    which ``linear_group`` reads, instead of weight by weight.
    Returns 0 without oneDNN, or when packing fails on this build."""
    if not onednn_available():
        return 0
    count = 0
    in_groups: set[int] = set()
    for group in joint_groups(model):
        weights = [m.weight for m in group]
        joint = joint_weight(weights)
        if joint is not None:
            in_groups.update(id(w) for w in weights)
            if joint not in _packed and _pack(joint, _versions(weights)) is not None:
                count += 1
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, nn.Linear) and _packable(weight) and id(weight) not in in_groups
                and weight not in _packed and _pack(weight) is not None):
            count += 1
    return count


def unpack_linears(model: nn.Module) -> None:
    """Drop ``model``'s packed copies (their memory is freed once no product holds them)."""
    for group in joint_groups(model):
        joint = joint_weight([m.weight for m in group])
        if joint is not None:
            _packed.pop(joint, None)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            _packed.pop(weight, None)


def packed_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The packed copy of ``weight``, packed again first if the weight changed; None if
    it was never packed (or no longer can be: a cast to another dtype or device)."""
    entry = _packed.get(weight)
    if entry is None:
        return None
    version, address, packed = entry
    if weight._version == version and weight.data_ptr() == address:
        return packed
    if not _packable(weight):
        del _packed[weight]
        return None
    return _pack(weight)


def packed_joint_weight(joint: torch.Tensor, weights: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The packed copy of the joint weight of ``weights`` (joint_weights.py), packed again
    first if any of them changed: each weight has its own version counter, which the
    joint view does not share."""
    entry = _packed.get(joint)
    if entry is None:
        return None
    version, address, packed = entry
    versions = _versions(weights)
    if version == versions and joint.data_ptr() == address:
        return packed
    return _pack(joint, versions)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed from ``weight``'s packed copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packable(weight) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32
            and weight.device.type == "cpu")


def _versions(weights: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(w._version for w in weights)


def _pack(weight: torch.Tensor, version=None) -> Optional[torch.Tensor]:
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:  # a build whose oneDNN refuses this shape or layout: keep the plain product
        _packed.pop(weight, None)
        return None
    _packed[weight] = (weight._version if version is None else version, weight.data_ptr(), packed)
    return packed
