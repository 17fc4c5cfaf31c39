"""Process- and thread-level CPU settings: the allocator tuning a user asks for, and the
release of idle OpenMP workers the CPU runner does for its own threads.

``tune_process`` is the one explicit call (the CLI verbs make it; library users may): torch's
CPU tensors come from glibc ``malloc``, which by default serves every block above a
threshold with a fresh ``mmap`` and hands it back to the kernel when freed. A training step
or a prefill frees and re-allocates the same activation-sized blocks every time, so each
one is faulted in again page by page. The tuning keeps blocks up to 32 MiB on the heap and
freed memory up to 1 GiB mapped, the effect an LD_PRELOADed jemalloc or tcmalloc has
(PyTorch's CPU tuning guide recommends those); the cost is a resident set that does not
shrink back after a peak. It changes the whole process, which is why nothing does it
behind a user's back; ``ASTRAI_TUNE_MALLOC=0`` turns the call into a no-op.

``release_thread_pool``: torch's CPU build runs its intra-op parallelism on GNU OpenMP,
which gives every thread that runs a parallel op its own pool of workers. libgomp lets idle
workers spin before sleeping unless the process holds more OpenMP threads than CPUs, in
which case every small op pays a futex sleep and wake-up per worker. The engine computes on
its scheduler thread while the thread that built the model still holds a pool of its own,
so the runner pauses the calling thread's pool (``omp_pause_resource_all``, OpenMP 5.0)
from the thread that built it (a server's loader thread lives on and never submits), from
the threads that hand it work, and from its own before it goes idle; libgomp builds a
fresh pool the next time that thread runs a parallel op. This touches only threads' idle
workers, never a setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
from typing import Optional

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
OMP_PAUSE_SOFT = 1


@functools.cache
def tune_process() -> bool:
    """Apply the malloc settings (glibc on Linux only), once; True if they are in force."""
    if os.environ.get("ASTRAI_TUNE_MALLOC", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))


@functools.lru_cache(maxsize=1)
def _pause_function() -> Optional[ctypes._CFuncPtr]:
    """``omp_pause_resource_all`` of the libgomp torch loaded, or None (other runtimes, older libgomp)."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        pause = getattr(library, "omp_pause_resource_all", None)
        if pause is not None:
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


def release_thread_pool() -> bool:
    """Return the calling thread's idle OpenMP workers to the system (if it has any).

    True when torch's libgomp took the request, False where there is nothing to call
    (another OpenMP runtime, or a libgomp without OpenMP 5.0's pause). Never call it from
    inside a parallel region (Python code never runs in one).
    """
    pause = _pause_function()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
