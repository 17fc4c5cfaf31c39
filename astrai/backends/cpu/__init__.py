"""The CPU backend: C kernels, serving layout, fused decode, oneDNN matmuls for training, tuning.

It registers itself for the device kind "cpu" (astrai/backends/__init__.py) with:

- ``CpuModelRunner`` (runner.py): the inference engine's runner on the CPU, which prepares
  its own copy of the model for serving and runs fused decode steps and greedy runs, its
  decode steps counted as "fused", "row_kernels", "batched" or "torch";
- the attention backend it binds (attention.py) and its decode buffers (decode_buffers.py);
- ``agree_on_matmuls`` and ``fast_training_matmuls`` (training.py): a run's decision on
  oneDNN's fp32 matmuls and the trainer's opt-in to them; ``cpu_bf16_matmul_pays``: whether
  this CPU's bf16 matmuls (AMX, AVX-512-BF16) are fast enough to try bf16 autocast training;
- ``tune_process`` (tuning.py): the process-wide allocator tuning, and
  ``release_thread_pool``: a thread's idle OpenMP workers given back;
- bfloat16 weights on the CPU cast the linear weights only (activations and KV cache stay fp32;
  each linear multiplies its input rounded to bf16, summing in fp32).

Importing this package builds and imports nothing heavy: the C library is compiled on first
use, and the parts (and the two names below) are imported when first asked for
(``tune_process`` without torch).
"""

import importlib

from astrai.backends import Backend, register

__all__ = ["fast_training_matmuls", "tune_process"]
_HOMES = {"fast_training_matmuls": "astrai.backends.cpu.training", "tune_process": "astrai.backends.cpu.tuning"}

register(Backend(
    kind="cpu",
    runner="astrai.backends.cpu.runner:CpuModelRunner",
    decode_paths=("fused", "row_kernels", "batched", "torch"),
    release_idle_hook="astrai.backends.cpu.tuning:release_thread_pool",
    prepare_process_hook="astrai.backends.cpu.tuning:tune_process",
    training_state_hook="astrai.backends.cpu.training:agree_on_matmuls",
    training_matmuls_hook="astrai.backends.cpu.training:fast_training_matmuls",
    bf16_linears_only=True,
    bf16_training_hook="astrai.backends.cpu.training:cpu_bf16_matmul_pays",
))


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
