"""Comparing evaluation figures from two runs: exactly on the CPU, whose sums repeat from run to
run; to 1e-6 (relative) where a GPU is visible, since cuBLAS may choose another kernel for the
same product (the caching allocator's addresses differ between runs), moving the last digits."""

import math

import torch


def same_figures(got, expected) -> bool:
    return got == expected if not torch.cuda.is_available() else _close(got, expected)


def _close(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b
