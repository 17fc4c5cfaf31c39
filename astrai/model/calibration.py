"""Calibrated int4: Q4_0 scales chosen by how much each input channel matters.

Q4_0's own rule maps each block's largest weight to the end of the 4-bit range. That
minimises nothing in particular; what a quantized linear should preserve is its output,
and an input channel that carries large activations moves the output more per unit of
weight error than a quiet one. So the scale of each block of 32 is chosen to minimise the
block's weight error weighted by the mean square activation of each input channel,
measured on a little calibration text (``activation_importance``): a handful of candidate
scales around Q4_0's, each refitted by weighted least squares to the levels it rounds to,
the best kept. The stored numbers stay plain Q4_0 (a nibble per weight, one fp16 scale per
block), so kernels, files and GGUF export do not change; only the choice of scale does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from astrai.errors import DataError
from astrai.model.quantized import quantization_targets

CALIBRATION_TOKENS = 4096  # about eight windows of text: enough for a stable mean square per channel
CALIBRATION_WINDOW = 512


def calibration_ids(tokenizer, path: str | Path, tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``tokens`` token ids of the documents of ``path`` (.jsonl with "text" or .txt)."""
    from astrai.eval.perplexity import read_documents

    ids: list[int] = []
    for doc in read_documents(path):
        ids += tokenizer.encode(doc, add_special_tokens=False)
        if len(ids) >= tokens:
            break
    if not ids:
        raise DataError(f"{path}: no text to calibrate on")
    return ids[:tokens]


@torch.no_grad()
def activation_importance(model: nn.Module, token_ids: list[int], names: Iterable[str],
                          window: int = CALIBRATION_WINDOW,
                          progress: Optional[Callable[[int], None]] = None) -> dict[str, torch.Tensor]:
    """Mean square of each input channel of the named linears over ``token_ids``, run through
    the float ``model`` in windows of ``window`` tokens: {name: float32 [in_features]}.
    ``progress`` is called with 1 after each window."""
    sums: dict[str, list] = {}
    hooks = []

    def record(name):
        def hook(module, inputs, output):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            total = sums.setdefault(name, [torch.zeros(x.shape[-1]), 0])
            total[0] += (x * x).sum(0)
            total[1] += x.shape[0]
        return hook

    for name in names:
        hooks.append(model.get_submodule(name).register_forward_hook(record(name)))
    device = next(model.parameters()).device
    try:
        for start in range(0, len(token_ids), window):
            model(torch.tensor([token_ids[start:start + window]], device=device))
            if progress is not None:
                progress(1)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: total[0] / max(total[1], 1) for name, total in sums.items()}


def calibration_windows(model: nn.Module, tokens: int) -> tuple[int, int]:
    """(window, count): windows of CALIBRATION_WINDOW tokens, or of the model's ``max_len`` when
    that is shorter, and how many of them ``tokens`` tokens fill."""
    max_len = getattr(getattr(model, "config", None), "max_len", CALIBRATION_WINDOW)
    window = min(CALIBRATION_WINDOW, max_len)
    return window, -(-tokens // window)


def calibrate(model: nn.Module, tokenizer, path: str | Path, tokens: int = CALIBRATION_TOKENS,
              progress: Optional[Callable[[int], None]] = None) -> dict[str, torch.Tensor]:
    """The importance of every input channel of the linears ``quantize_model(model, "int4")``
    makes int4, measured on the first ``tokens`` tokens of ``path`` in windows the model takes
    (``calibration_windows``): pass the result to ``quantize_model(..., importance=...)``.
    ``progress`` is called with 1 after each window."""
    names = [name for name, bits in quantization_targets(model, 4) if bits == 4]
    window, _ = calibration_windows(model, tokens)
    was_training = model.training
    model.eval()
    try:
        return activation_importance(model, calibration_ids(tokenizer, path, tokens), names, window, progress)
    finally:
        model.train(was_training)
