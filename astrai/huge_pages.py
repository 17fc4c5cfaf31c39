"""Buffers in 2 MiB pages, for the weights a CPU decode step streams.

A one-row decode step reads every weight matrix once, in turn, and on a CPU the fused step (inference/fused_decode.py) spends almost all its time doing that. With
the usual 4 KiB pages, streaming 500 MB of weights touches 120,000 pages, and each new
page costs a TLB miss; the hardware prefetchers also stop at page boundaries. Linux can
back memory with 2 MiB pages instead (transparent huge pages), but with the common
``madvise`` setting only for memory that asks for them, and torch's allocator does not
ask. So the engine lays its weights (inference/weight_layout.py) into buffers made here: an
anonymous mapping advised ``MADV_HUGEPAGE``, aligned to 2 MiB, which makes single-request
decode of a ~125M model a few percent faster (docs/benchmarks.md). The KV decode buffers
gain nothing measurable from them, so they stay plain.

Anywhere this cannot work (not Linux, huge pages switched off, a buffer smaller than one
huge page, ``ASTRAI_HUGE_PAGES=0``) ``huge_page_empty`` is plain ``torch.empty``: the
pages change only how fast the memory is read, never what is in it.
"""

from __future__ import annotations

import math
import mmap
import os
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory is advised for 2 MiB pages where that is possible."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not huge_pages_available():
        return torch.empty(shape, dtype=dtype)
    try:
        # private: a shared anonymous mapping is shmem, which follows another huge-page setting
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # e.g. the map count or an overcommit limit reached: torch's allocator may still manage
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive; nothing touched yet
    pad = -raw.data_ptr() % HUGE_PAGE_BYTES  # the extra 2 MiB make room to start on a boundary
    whole = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    try:
        # only the whole 2 MiB pages: advising the partial last one too would make it a full
        # huge page of resident memory (some 60 MiB, 12%, over the 125M model's 49 buffers)
        region.madvise(mmap.MADV_HUGEPAGE, pad, whole)  # before the first touch, which picks the page size
    except OSError:
        return torch.empty(shape, dtype=dtype)
    return raw[pad:pad + nbytes].view(dtype).view(shape)


def huge_pages_available() -> bool:
    """True on Linux with transparent huge pages not set to ``never`` and not switched off
    by ``ASTRAI_HUGE_PAGES=0``."""
    if os.environ.get("ASTRAI_HUGE_PAGES", "1") == "0":
        return False
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False
