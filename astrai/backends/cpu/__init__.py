"""The CPU backend: C kernels, serving layout, fused decode, oneDNN training products, tuning.

- ``CpuModelRunner`` (runner.py): the inference engine's runner on the CPU, which prepares
  its own copy of the model for serving and runs fused decode steps and greedy runs;
- the attention backend it binds (attention.py) and its decode buffers (decode_buffers.py);
- ``fast_training_products`` (training.py): the trainer's opt-in to oneDNN's fp32 products;
- ``tune_process`` (tuning.py): the explicit process-wide allocator tuning.

Importing this package builds and imports nothing heavy: the C library is compiled on first
use, and the two names below are imported when first asked for (``tune_process`` without torch).
"""

import importlib

__all__ = ["fast_training_products", "tune_process"]
_HOMES = {"fast_training_products": "astrai.backends.cpu.training", "tune_process": "astrai.backends.cpu.tuning"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
