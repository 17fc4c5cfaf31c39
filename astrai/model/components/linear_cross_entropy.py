"""Cross-entropy of the vocabulary projection, fused and computed a few rows at a time.

The usual way - logits = h @ Wᵀ for every token, then ``F.cross_entropy`` - builds the
[tokens, vocab] logits, their log-softmax and, in backward, a zeroed gradient of the
same size, each streamed through memory several times. Here the rows are processed in
chunks of 256 tokens: each chunk's logits become the loss and, at once, the gradient
with respect to them (softmax − target distribution), which is pushed straight into the
gradients of the hidden states and the weight. Backward then only scales those by the
incoming gradient. The arithmetic is the same; only the memory traffic is gone.

Each chunk's logits are computed transposed, ``weight @ hidden.T`` = [vocab, rows]: with
the vocabulary as the matmul's long side the CPU BLAS runs it faster, and the two
gradient matmuls then take the transposed chunk as it lies.

The matmuls run on ``torch.mm`` unless the caller passes ``matmul`` (a function giving
``a @ bᵀ``), or a device backend installed one for a training run (``head_matmuls``: the
CPU's faster fp32 matmul): then the forward matmul and the weight gradient take it, the latter
as one matmul per group of chunks.
In bf16 the weight gradient is grouped the same way, because it has to end in fp32: a
bf16 matmul per chunk added into the fp32 gradient would cost a widening pass and a
weight-sized temporary each time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch


IGNORE_INDEX = -100
CHUNK_ROWS = 256  # tokens per chunk: fewer rows starve the matmuls, more buy little (measured, 8k and 32k vocabularies)
GRADIENT_ROWS_BYTES = 64 * 2 ** 20  # the chunks' logit gradients kept for one weight-gradient matmul


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (``ignore_index`` skipped)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, label_smoothing, compute_dtype, matmul, softmax):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, vocab = hidden.shape[0], weight.shape[0]
        valid = targets != ignore_index
        count = valid.sum()
        safe_targets = torch.where(valid, targets, 0)
        row_weight = valid.to(torch.float32) / count.clamp_min(1)
        w = weight.to(compute_dtype)
        h_all = hidden.to(compute_dtype)
        matmuls = ChunkMatmuls(w, matmul)
        chunk = min(CHUNK_ROWS, max(n, 1))
        group = matmuls.gradient_group_rows(chunk) if need_weight else chunk
        # the chunks' fp32 logits, reused; a given matmul function returns its own, and the
        # softmax kernel reads bf16 logits as they are
        fresh = matmuls.matmul is not None or (softmax is not None and compute_dtype != torch.float32)
        workspace = None if fresh else torch.empty(vocab * chunk, dtype=torch.float32, device=hidden.device)
        need_gradients = need_hidden or need_weight
        # a group's logit gradients; ungrouped (fp32 on MKL) each chunk's go in place of its logits
        gradients = (torch.empty(vocab, min(group, n), dtype=compute_dtype, device=hidden.device)
                     if need_gradients and matmuls.grouped else None)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        allocate = torch.empty if n else torch.zeros  # no rows: no matmul writes the weight gradient
        grad_weight = allocate(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            target = safe_targets[None, start:start + rows]
            scale = row_weight[None, start:start + rows]
            column = start % group
            # logits transposed, [vocab, rows]: the matmul runs faster with the vocabulary as
            # its long side (see the module's docstring); softmax is taken down the columns
            out = None if workspace is None else workspace[:vocab * rows].view(vocab, rows)
            if softmax is not None:  # one kernel reads the logits as the matmul gave them
                logits = matmuls.logits(h_all[start:start + rows], out, widen=False)
                grad = None if not need_gradients else logits if gradients is None else gradients[:, column:column + rows]
                total += softmax(logits, target[0], scale[0], label_smoothing, grad) @ scale[0]
            else:
                grad = chunk_softmax_gradient(matmuls.logits(h_all[start:start + rows], out), target, scale,
                                              label_smoothing, gradients, column, need_gradients, total)
            if not need_gradients:
                continue
            if need_hidden:
                matmuls.hidden_gradient(grad, grad_hidden[start:start + rows])
            if need_weight and (column + rows == group or start + rows == n):
                first = start - column
                group_grad = grad if gradients is None else gradients[:, :column + rows]
                matmuls.weight_gradient(group_grad, h_all[first:start + rows], grad_weight, accumulate=first > 0)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        # mean over counted tokens; 0/0 = nan when nothing counts, as F.cross_entropy gives
        return total * count.clamp_min(1) / count

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunk_softmax_gradient(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, label_smoothing: float,
                           gradients: Optional[torch.Tensor], column: int, need_gradients: bool,
                           total: torch.Tensor) -> Optional[torch.Tensor]:
    """One chunk's loss added into ``total`` and, when ``need_gradients``, its logit gradient
    (softmax − target distribution) × each row's weight: in ``gradients[:, column:]`` when
    gradients are grouped, else in place of the fp32 ``logits`` (returned). PyTorch's ops; a
    device backend may install one kernel for the same (``HeadMatmuls.softmax_gradient``)."""
    target_logit = logits.gather(0, target)
    mean_logit = logits.mean(dim=0, keepdim=True) if label_smoothing else None
    row_max = logits.amax(dim=0, keepdim=True)
    exp = logits.sub_(row_max).exp_()  # in place: the logits are not needed any more
    exp_sum = exp.sum(dim=0, keepdim=True)
    lse = row_max + exp_sum.log()
    loss = lse - target_logit
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - mean_logit)
    total += (loss * scale).sum()
    if not need_gradients:
        return None
    rows = logits.shape[1]
    grad = exp if gradients is None else gradients[:, column:column + rows]
    # (softmax − target distribution) × this row's weight = (exp − exp_sum·target) × scale/exp_sum,
    # the target subtracted before the one pass that scales (and casts) into the gradient rows
    exp.scatter_add_(0, target, -(1 - label_smoothing) * exp_sum)
    if label_smoothing:
        exp.sub_(label_smoothing / logits.shape[0] * exp_sum)
    torch.mul(exp, scale / exp_sum, out=grad)
    return grad


class ChunkMatmuls:
    """The projection's three matmuls for one call, each on the kernel that runs it fastest.

    In fp32 the forward matmul ``W @ hᵀ`` and the weight gradient ``G @ h`` take
    ``matmul`` when one is given, else ``torch.mm`` writing in place. In bf16 every matmul
    is the BLAS's; there the logits come out in bf16 and are
    widened into the fp32 workspace, and the weight gradient, which has to end in fp32,
    is one matmul over a whole group of chunks (``gradient_group_rows``) instead of a
    bf16 matmul per chunk added into fp32, which cost a widening pass and a fresh
    temporary of the weight's size each time.
    """

    def __init__(self, weight: torch.Tensor, matmul: Optional[Callable] = None):
        self.weight = weight
        fp32 = weight.dtype == torch.float32
        self.matmul = matmul if fp32 else None
        # a weight gradient matmul per chunk, accumulated in place, is free in fp32 on the BLAS
        self.grouped = not fp32 or self.matmul is not None

    def gradient_group_rows(self, chunk: int) -> int:
        """Rows per weight-gradient matmul: a multiple of ``chunk`` whose gradients fit
        ``GRADIENT_ROWS_BYTES`` (at least one chunk)."""
        if not self.grouped:
            return chunk
        per_row = self.weight.shape[0] * self.weight.element_size()
        return max(1, GRADIENT_ROWS_BYTES // (per_row * chunk)) * chunk

    def logits(self, h: torch.Tensor, out: Optional[torch.Tensor], widen: bool = True) -> torch.Tensor:
        """``W @ hᵀ`` [vocab, rows] in fp32: in ``out``, or a fresh tensor from ``matmul`` (``out``
        None); without ``widen``, bf16 logits stay as the bf16 matmul gives them."""
        if self.matmul is not None:
            return self.matmul(self.weight, h)
        if self.weight.dtype == torch.float32:
            return torch.mm(self.weight, h.t(), out=out)
        return out.copy_(self.weight @ h.t()) if widen else self.weight @ h.t()

    def hidden_gradient(self, grad: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = ``gradᵀ @ W`` [rows, dim]: the BLAS's matmul in either precision, written in
        place (with the vocabulary as its inner dimension a given ``matmul`` gains nothing here)."""
        if self.weight.dtype == out.dtype:
            torch.mm(grad.t(), self.weight, out=out)
        else:
            out.copy_(grad.t() @ self.weight)

    def weight_gradient(self, grad: torch.Tensor, h: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """``out`` (fp32) = or += ``grad @ h`` [vocab, dim]."""
        if not self.grouped:
            torch.addmm(out, grad, h, beta=1 if accumulate else 0, out=out)
            return
        gradient = self.matmul(grad, h.t()) if self.matmul is not None else grad @ h
        out.add_(gradient) if accumulate else out.copy_(gradient)


@dataclass(frozen=True)
class HeadMatmuls:
    """How the fused loss multiplies where a device backend knows better than the defaults, for
    the block it installs them in (``head_matmuls``; the CPU backend's training matmuls do):
    ``matmul(a, b)`` = ``a @ bᵀ`` replaces ``torch.mm`` for the fp32 matmuls, and
    ``low_precision_pays(device_type, dtype)`` says whether the projection should take
    autocast's ``dtype`` (else it stays in the weights' dtype), and
    ``softmax_gradient(logits, targets, scale, label_smoothing, grad)`` replaces
    ``chunk_softmax_gradient``'s ops for a chunk of fp32 or bf16 logits on ``device_type``:
    it returns the columns' unweighted losses and writes the weighted logit gradient into
    ``grad`` (None: the loss alone; it may be the fp32 logits themselves)."""

    matmul: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    low_precision_pays: Optional[Callable[[str, torch.dtype], bool]] = None
    softmax_gradient: Optional[Callable[..., torch.Tensor]] = None
    device_type: str = "cpu"


_installed = HeadMatmuls()  # the defaults: torch.mm, and autocast's dtype wherever autocast is on


@contextlib.contextmanager
def head_matmuls(matmuls: HeadMatmuls) -> Iterator[None]:
    """Within the block, every fused loss multiplies as ``matmuls`` says."""
    global _installed
    outer, _installed = _installed, matmuls
    try:
        yield
    finally:
        _installed = outer


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
                         matmul: Optional[Callable] = None) -> torch.Tensor:
    """Same value and gradients as ``F.cross_entropy(hidden @ weight.T, targets)`` (fp32 loss).

    ``hidden`` [..., D] and ``targets`` [...] are flattened. The projections run in
    ``projection_dtype``; softmax and the loss are always fp32. ``matmul(a, b)`` = ``a @ bᵀ``
    replaces ``torch.mm`` for the fp32 matmuls (see the module's docstring); without it,
    the installed ``HeadMatmuls``' ``matmul`` does, if any.
    """
    compute_dtype = projection_dtype(hidden.device.type, weight.dtype)
    matmul = matmul if matmul is not None else _installed.matmul
    softmax = _installed.softmax_gradient if hidden.device.type == _installed.device_type else None
    if compute_dtype not in (torch.float32, torch.bfloat16):
        softmax = None
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    counted = targets != ignore_index
    if not bool(counted.all()):
        # a row whose target does not count (a prompt token under SFT's loss mask, padding) adds
        # nothing to the loss or the gradients, so it skips the projection's three matmuls
        rows = counted.nonzero().squeeze(1)
        hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)
    with torch.autocast(hidden.device.type, enabled=False):
        return LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, float(label_smoothing),
                                        compute_dtype, matmul, softmax)


def projection_dtype(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the vocabulary projection: the autocast dtype where autocast is on, unless
    the installed ``HeadMatmuls`` says a matmul in that dtype does not pay on this device
    (the CPU backend's, for a CPU whose bf16 matmuls are no faster than its fp32 ones: there
    the largest matmul of a small model would lose time and the precision of the logits).
    The rest of the model follows autocast."""
    if not torch.is_autocast_enabled(device_type):
        return weight_dtype
    dtype = torch.get_autocast_dtype(device_type)
    pays = _installed.low_precision_pays
    return dtype if pays is None or pays(device_type, dtype) else weight_dtype
