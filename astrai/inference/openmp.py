"""Release a thread's idle OpenMP workers so the engine's compute thread runs at full speed.

torch's CPU build runs its intra-op parallelism on GNU OpenMP (libgomp), which gives
every thread that runs a parallel op its own pool of worker threads. libgomp lets
idle workers spin briefly before sleeping - unless the process holds more OpenMP
threads than it has CPUs, in which case it cuts the spin to almost nothing, and every
small op then pays a futex sleep and wake-up per worker. The engine computes on its
scheduler thread, while the thread that built the model (usually the main thread)
still holds a pool of its own: together they exceed the CPUs of a small machine, and
a tiny model's decode step was measured 3-4x slower on the scheduler thread than the
same forward on the main thread. Pausing the other thread's pool
(``omp_pause_resource_all``, OpenMP 5.0) removes its workers from the count; libgomp
builds a fresh pool the next time that thread runs a parallel op, at the cost of a
thread start.

``release_thread_pool`` releases the calling thread's pool only - OpenMP offers no
way to touch another thread's - so the engine calls it from the threads that hand it
work (``submit``) and from its own thread before it goes idle.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from typing import Optional

import torch

OMP_PAUSE_SOFT = 1


@functools.lru_cache(maxsize=1)
def _pause_function() -> Optional[ctypes._CFuncPtr]:
    """``omp_pause_resource_all`` of the libgomp torch loaded, or None (other runtimes, older libgomp)."""
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
    (another OpenMP runtime, or a libgomp without OpenMP 5.0's pause).

    Never call it from inside a parallel region (Python code never runs in one).
    """
    pause = _pause_function()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
