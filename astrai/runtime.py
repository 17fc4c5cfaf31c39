"""Process-wide CPU settings that decide how fast torch runs here: glibc's allocator.

torch's CPU tensors come from glibc ``malloc``. By default glibc serves every block
above a threshold (128 KiB at first, at most 32 MiB) with a fresh ``mmap`` and hands
it back to the kernel when freed, and trims the heap's free top the same way. A
training step or a prefill frees and re-allocates the same activation-sized blocks
every time, so each one is faulted in again page by page, which can cost more than the
arithmetic on small tensors (docs/benchmarks.md has a measurement). ``tune_allocator`` keeps blocks up to 32 MiB on the heap and freed memory up
to 1 GiB mapped, the effect an LD_PRELOADed jemalloc or tcmalloc has (PyTorch's CPU
tuning guide recommends those); the cost is a resident set that does not shrink back
after a peak. It changes the whole process (everything in it runs faster), is done
once, and ``ASTRAI_TUNE_MALLOC=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_tuned: bool | None = None


def tune_allocator() -> bool:
    """Apply the malloc settings once (glibc on Linux only); True if they are in force."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("ASTRAI_TUNE_MALLOC", "1") == "0" or not sys.platform.startswith("linux"):
        return _tuned
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return _tuned
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = all(mallopt(option, value) == 1 for option, value in
                 ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    return _tuned
