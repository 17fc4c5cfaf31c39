"""Where and in what precision the engine holds a model, from the ``--device``/``--dtype`` flags.

``auto`` means what a user with that machine wants without asking: a visible GPU rather than
the CPU, and on a GPU with native bf16 the weights in bf16 (half the memory traffic of fp32 per
decoded token, the quantity decode speed is bound by). On the CPU, ``auto`` keeps the dtype the
weights were saved in: the engine's hand-written CPU decode kernels are fp32-only.
"""

from __future__ import annotations

from typing import Optional

import torch

from astrai.errors import ConfigError
from astrai.parallel.setup import get_current_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *sorted(DTYPES))


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` → the current GPU when one is visible, else the CPU; a GPU asked for must exist."""
    if name == "auto":
        return get_current_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device (auto, cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ConfigError(f"--device {name}: this machine has {count} visible GPU(s)")
    return device


def resolve_dtype(name: Optional[str], device: torch.device) -> Optional[torch.dtype]:
    """The dtype to load the weights in; None keeps the saved one."""
    if name is None or name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16
        return None
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def resolve_placement(device: str = "auto", dtype: Optional[str] = "auto") -> tuple[torch.device, Optional[torch.dtype]]:
    resolved = resolve_device(device)
    return resolved, resolve_dtype(dtype, resolved)
