"""Device backends: everything that exists only to make one kind of hardware fast, found by device kind.

The model (astrai/model) is plain PyTorch, and the engine, runner base, trainer and CLI name
no device. What they ask of a device they ask its ``Backend``, looked up by the device's kind
(``backend_for(torch.device("cpu"))``, ``backend_for("cuda:1")``):

- ``runner``: the model runner that serves on it (a subclass of astrai.inference.runner's
  ``ModelRunner``), and ``decode_paths``, the names its decode steps are counted under;
- ``release_idle()``: what a thread that stops computing for a while gives back (the CPU:
  its idle OpenMP workers);
- ``prepare_process()``: the process-wide tuning a CLI compute verb asks for (never done
  behind a library user's back);
- ``training_state(model, recorded)`` and ``training_matmuls(model, state)``: a run's
  decision on faster training matmuls, kept in its checkpoints, and the block it holds;
- ``bf16_linears_only``: whether bfloat16 weights mean the linear weights only;
- ``bf16_training_pays()``: whether bf16 autocast could train faster than fp32 here (worth a
  caller's probe; the plain answer is no, and a GPU's ``auto`` precision decides for itself).

A backend is a folder ``astrai/backends/<kind>/`` whose ``__init__`` calls ``register``; the
registry imports that package the first time its kind is asked for, so adding a backend
edits nothing else. A kind with no backend gets ``Backend(kind)``: the plain behaviour.
The parts are named as ``"module:attribute"`` (the form of Python's entry points) and
imported when first used: a runner builds on astrai.inference, which sits above this
package, and the process tuning must not load torch.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

PLAIN_DECODE_PATH = "torch"  # the model's own forward: the one path every runner has

_BACKENDS: dict[str, "Backend"] = {}


def _resolve(reference: str) -> Any:
    """The object a ``"module:attribute"`` reference names (the module is imported once;
    the attribute is read at every call, so a test may replace it)."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Backend:
    """One device kind's answers to the device-neutral code (see the module's docstring).
    Every part left out keeps the plain behaviour."""

    kind: str
    runner: Optional[str] = None  # "module:Class", a ModelRunner subclass; None: the plain runner
    decode_paths: tuple[str, ...] = (PLAIN_DECODE_PATH,)
    release_idle_hook: Optional[str] = None  # "module:function()"
    prepare_process_hook: Optional[str] = None  # "module:function()"
    training_state_hook: Optional[str] = None  # "module:function(model, recorded) -> state or None"
    training_matmuls_hook: Optional[str] = None  # "module:function(model, state) -> context manager"
    bf16_linears_only: bool = False
    bf16_training_hook: Optional[str] = None  # "module:function() -> bool"

    def __post_init__(self):
        if PLAIN_DECODE_PATH not in self.decode_paths:
            raise ValueError(f"backend {self.kind!r}: decode_paths must include {PLAIN_DECODE_PATH!r}, the model's "
                             f"own forward, which every runner falls back to")

    def runner_class(self) -> Optional[type]:
        """The model runner class for serving on this device, or None for the plain one."""
        return None if self.runner is None else _resolve(self.runner)

    def release_idle(self) -> None:
        """The calling thread computes nothing for a while: give back what it holds idle."""
        if self.release_idle_hook is not None:
            _resolve(self.release_idle_hook)()

    def prepare_process(self) -> None:
        """Apply the process-wide tuning for this device (an explicit, process-wide change)."""
        if self.prepare_process_hook is not None:
            _resolve(self.prepare_process_hook)()

    def bf16_training_pays(self) -> bool:
        """Whether this device's bf16 matmuls are fast enough that bf16 autocast may train
        faster than fp32: a cue to time both, not a decision."""
        return self.bf16_training_hook is not None and bool(_resolve(self.bf16_training_hook)())

    def training_state(self, model: Any, recorded: Any = None) -> Optional[dict]:
        """The run's decision on faster training matmuls for ``model`` (JSON, kept in its
        checkpoints), taking ``recorded`` (an earlier run's) where the backend accepts it; None
        when there is nothing to decide. A collective under torch.distributed: every rank calls it."""
        if self.training_state_hook is None:
            return None
        return _resolve(self.training_state_hook)(model, recorded)

    def training_matmuls(self, model: Any, state: Optional[dict]) -> ContextManager:
        """The block within which ``model`` trains with the matmuls ``state`` decided."""
        if self.training_matmuls_hook is None:
            return contextlib.nullcontext()
        return _resolve(self.training_matmuls_hook)(model, state)


def register(backend: Backend) -> None:
    """Make ``backend`` the one for its device kind (a later registration replaces it)."""
    _BACKENDS[backend.kind] = backend


def device_kind(device: Any) -> str:
    """The kind of ``device``: a ``torch.device``'s type, or a name's part before any index."""
    kind = getattr(device, "type", None)
    return kind if isinstance(kind, str) else str(device).partition(":")[0]


def backend_for(device: Any) -> Backend:
    """The backend registered for ``device``'s kind (its package under astrai/backends is
    imported on first asking), else the plain ``Backend(kind)``."""
    kind = device_kind(device)
    if kind not in _BACKENDS and kind.isidentifier() and importlib.util.find_spec(f"{__name__}.{kind}") is not None:
        importlib.import_module(f"{__name__}.{kind}")
    return _BACKENDS.get(kind) or Backend(kind)
