"""How the CPU runner prepares its model for serving: weight layout and serving modules.

Without autograd, the products of a decode step are few rows by large weights, which the
CPU runs faster by other routes than ``F.linear`` takes (``serving_product``):

- one row through the C one-row product (kernels.py), which gives each thread one
  contiguous stretch of the weight's rows to stream;
- several rows from the weight's oneDNN-packed copy (made once, packed again only when the
  weight changed: an ``update_weights`` copies new values in place);
- otherwise, up to 64 rows, as one batched product over the weight's two halves of
  outputs, which keeps both threads of a small machine busy where the BLAS would not.

``prepare_for_serving`` arranges the runner's own copy of the model for them: the linears
that read the same input (a module's ``input_projections()``: q/k/v, gate/up) are stacked
in one buffer, every weight a view of its block of rows, and the module becomes its
serving subclass, whose ``project`` runs the group as one product over the joint weight -
one longer stream per thread, one call instead of three; large weights sit in huge-page
memory (huge_pages.py); every other plain linear becomes a ``ServingLinear``. Values,
parameter names and ties never change, so the model's state dict is the same.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from astrai.backends.cpu.huge_pages import HUGE_PAGE_BYTES, huge_page_empty, huge_pages_available
from astrai.backends.cpu.kernels import kernels_available, row_major, row_product
from astrai.backends.cpu.training import OneDnnLinear
from astrai.model.components.attention import GQA, MLA
from astrai.model.components.ffn import MLP
from astrai.model.components.layers import Linear

SPLIT_MAX_ROWS = 64  # products of at most this many rows are split in two (see serving_product)


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed fp32 linear (x86 builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedWeight:
    """A weight's oneDNN-packed copy, packed again before its next use when any of the weights
    it was made from changed (their version counters or the address moved)."""

    def __init__(self, weight: torch.Tensor, sources: Sequence[torch.Tensor]):
        self.weight, self.sources = weight, list(sources)
        self._stamp: Optional[tuple] = None
        self._packed: Optional[torch.Tensor] = None

    def get(self) -> Optional[torch.Tensor]:
        stamp = (self.weight.data_ptr(), *(w._version for w in self.sources))
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            except RuntimeError:  # a build whose oneDNN refuses this shape: the other products remain
                self._packed = None
        return self._packed


def serving_product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    packed: Optional[PackedWeight]) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the fastest route for an fp32 CPU product without
    autograd (see the module's docstring)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled():
        if x.numel() != x.shape[-1]:  # one row streams the plain weight faster than the packed copy
            copy = None if packed is None else packed.get()
            if copy is not None:
                return torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")
        elif (weight.dtype == torch.float32 and x.is_contiguous() and row_major(weight)
              and (bias is None or bias.dtype == torch.float32) and kernels_available()):
            return row_product(x, weight, None if bias is None else bias.contiguous())
        if (x.numel() <= SPLIT_MAX_ROWS * x.shape[-1] and weight.dtype == torch.float32 and weight.is_contiguous()
                and weight.shape[0] % 2 == 0 and torch.get_num_threads() > 1):
            return _split_product(x, weight, bias)
    return F.linear(x, weight, bias)


def _split_product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a contiguous ``weight`` with an even number of
    outputs, as one ``bmm`` over its two halves of rows (one thread each)."""
    n_out, n_in = weight.shape
    rows = x.reshape(-1, n_in)
    halves = torch.bmm(weight.view(2, n_out // 2, n_in), rows.t().expand(2, n_in, rows.shape[0]))  # [2, out/2, R]
    out = halves.permute(2, 0, 1).reshape(rows.shape[0], n_out)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n_out)


class ServingLinear(Linear):
    """A linear whose forward is ``serving_product`` over its weight and packed copy."""

    packed: Optional[PackedWeight] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return serving_product(x, self.weight, self.bias, self.packed)


class JointProduct:
    """The linears of one group as one product over their stacked weight, split afterwards.

    Checks before each product that the weights still lie where they were stacked (a caller
    that consented to in-place preparation may assign new tensors); if not, the group runs
    module by module."""

    def __init__(self, modules: Sequence[nn.Linear], weight: torch.Tensor):
        self.modules = tuple(modules)
        self.weight = weight
        self.sizes = [m.out_features for m in modules]
        self._addresses = [m.weight.data_ptr() for m in modules]
        self.packed = PackedWeight(weight, [m.weight for m in modules]) if onednn_available() else None

    def current(self) -> Optional[torch.Tensor]:
        """The joint weight while every member's weight is still its block of it, else None."""
        return self.weight if [m.weight.data_ptr() for m in self.modules] == self._addresses else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.current() is None:
            return [m(x) for m in self.modules]
        parts = serving_product(x, self.weight, None, self.packed).split(self.sizes, dim=-1)
        return [part if m.bias is None else part + m.bias for part, m in zip(parts, self.modules)]


class _JointProjection:
    """Serving subclasses' ``project``: the module's input projections as one product."""

    joint: JointProduct

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        modules = self.input_projections()
        if modules != self.joint.modules:  # a member replaced since (a LoRA layer): each runs its own
            return [m(x) for m in modules]
        return self.joint(x)


class ServingGQA(_JointProjection, GQA):
    """GQA whose q/k/v (and gate) projections run as one product."""


class ServingMLA(_JointProjection, MLA):
    """MLA whose q and latent (and gate) projections run as one product."""


class ServingMLP(_JointProjection, MLP):
    """SwiGLU MLP whose gate and up projections run as one product."""


SERVING_CLASSES = {GQA: ServingGQA, MLA: ServingMLA, MLP: ServingMLP}


def prepare_for_serving(model: nn.Module) -> None:
    """Re-lay and re-class ``model``'s fp32 CPU linears for serving (see the module's docstring).
    The model must be the runner's own: its modules change class and its weights' memory moves."""
    with torch.no_grad():
        for module in model.modules():  # a copy taken mid-training: back to the model's own class
            if type(module) is OneDnnLinear:
                module.__class__ = Linear
        in_groups: set[int] = set()
        for module in list(model.modules()):
            serving = SERVING_CLASSES.get(type(module))
            group = module.input_projections() if serving is not None else ()
            joint = _stack(group, in_groups)
            if joint is not None:
                module.__class__ = serving
                module.joint = JointProduct(group, joint)
                _pack_now(module.joint.packed)
        laid: set[int] = set()
        for module in model.modules():
            if type(module) not in (Linear, nn.Linear) or not _movable(module.weight):
                continue
            weight = module.weight
            if id(weight) in in_groups:
                continue
            if id(weight) not in laid and weight.nbytes >= HUGE_PAGE_BYTES and huge_pages_available():
                moved = huge_page_empty(tuple(weight.shape))
                moved.copy_(weight.data)
                weight.data = moved
            laid.add(id(weight))
            module.__class__ = ServingLinear
            if onednn_available():
                module.packed = PackedWeight(weight, [weight])
                _pack_now(module.packed)


def _pack_now(packed: Optional[PackedWeight]) -> None:
    """Pack while preparing, so that the first request does not wait for it."""
    if packed is not None:
        packed.get()


def _movable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def _stack(group: Sequence[nn.Module], in_groups: set[int]) -> Optional[torch.Tensor]:
    """Copy the group's weights into one [total, in] buffer, each ``.data`` becoming its block
    of rows; the buffer, or None when the group is not of plain, distinct fp32 CPU linears of
    one input width."""
    if len(group) < 2 or any(type(m) not in (Linear, nn.Linear) for m in group):
        return None
    weights = [m.weight for m in group]
    if (any(id(w) in in_groups for w in weights) or len({id(w) for w in weights}) < len(weights)
            or not all(_movable(w) for w in weights) or len({w.shape[1] for w in weights}) > 1):
        return None
    in_groups.update(id(w) for w in weights)
    buffer = huge_page_empty((sum(w.shape[0] for w in weights), weights[0].shape[1]))
    start = 0
    for weight in weights:
        block = buffer[start:start + weight.shape[0]]
        block.copy_(weight.data)
        weight.data = block
        start += weight.shape[0]
    return buffer
