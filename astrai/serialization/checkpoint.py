"""Checkpoint: a training state on disk, one directory per save.

Layout of ``<dir>``::

    meta.json          epoch, iteration, meta (tokens seen, TrainConfig, ...), sha256 of every file
    model.safetensors  the weights (tied tensors stored once, aliases listed in meta.json)
    <name>.pt          each ``extra`` entry (optimizer, scheduler, sampler, RNG state)

Tensors never go through pickle: weights use safetensors and the ``extra`` files are
read back with ``torch.load(weights_only=True)``. ``save`` writes into a hidden
temporary directory and renames it into place, so a crash (even ``kill -9``) mid-save
leaves the previous checkpoint untouched; what such a crash leaves behind is cleared by
``remove_stale_saves`` at the next start (and before each save). ``load`` re-hashes
every file and refuses a truncated or edited checkpoint with a message naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from astrai.errors import CheckpointError

META_NAME = "meta.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1
_SAVE_LEFTOVER = re.compile(r"^\.(tmp|old)-(.+)-(\d+)$")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_saves(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Clear what saves killed midway left in ``ckpt_dir``; return the directories removed.

    A save writes ``.tmp-<name>-<pid>`` and, when replacing, parks the previous copy as
    ``.old-<name>-<pid>`` for an instant. Those of this process (not saving while this
    runs) or of a process that no longer exists are leftovers. If a kill fell between the
    two renames, ``<name>`` is missing: the complete new copy (or else the old one) is
    moved into place instead of being deleted, so no finished checkpoint is lost.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir(), key=lambda p: p.name.startswith(".old-")):  # temporaries first
        match = _SAVE_LEFTOVER.match(path.name)
        if not match or not path.is_dir():
            continue
        kind, name, pid = match.group(1), match.group(2), int(match.group(3))
        if pid != os.getpid() and _process_alive(pid):
            continue
        target = root / name
        finished = kind == "tmp" and (path / META_NAME).is_file()
        if not target.exists() and (kind == "old" or finished):
            os.rename(path, target)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _split_aliases(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each shared tensor (e.g. tied embedding/lm_head) once; remember the other names."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        unique[name] = tensor.to("cpu").contiguous()
    return unique, aliases


class Checkpoint:
    """Weights plus whatever else a run needs to continue (``extra``) and describe itself (``meta``)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], epoch: int = 0, iteration: int = 0,
                 extra: Optional[dict[str, Any]] = None, meta: Optional[dict[str, Any]] = None):
        self.state_dict = state_dict
        self.epoch = int(epoch)
        self.iteration = int(iteration)
        self.extra = dict(extra or {})
        self.meta = dict(meta or {})

    def save(self, save_dir: str | os.PathLike) -> Path:
        """Write atomically to ``save_dir`` (replacing an older save of the same name)."""
        target = Path(save_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_saves(target.parent)
        tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
        tmp.mkdir()
        tensors, aliases = _split_aliases(self.state_dict)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        for name, value in self.extra.items():
            torch.save(value, tmp / f"{name}.pt")
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        meta = {"format_version": FORMAT_VERSION, "epoch": self.epoch, "iteration": self.iteration,
                "aliases": aliases, "extra": sorted(self.extra), "files": files, "meta": self.meta}
        with open(tmp / META_NAME, "w", encoding="utf-8") as handle:
            json.dump(meta, handle, indent=2, ensure_ascii=False)
            handle.flush()
            os.fsync(handle.fileno())
        for path in tmp.iterdir():
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(tmp)
        if target.exists():
            old = target.parent / f".old-{target.name}-{os.getpid()}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        _fsync_dir(target.parent)
        return target

    @classmethod
    def read_meta(cls, save_dir: str | os.PathLike) -> dict[str, Any]:
        path = Path(save_dir) / META_NAME
        if not path.is_file():
            raise CheckpointError(f"{save_dir}: not a checkpoint (no {META_NAME})")
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt ({exc}); use an earlier checkpoint") from None
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION or "files" not in meta:
            raise CheckpointError(f"{path}: unknown checkpoint format")
        return meta

    @classmethod
    def verify(cls, save_dir: str | os.PathLike) -> dict[str, Any]:
        """Check every file against the hashes in meta.json; return the meta."""
        root = Path(save_dir)
        meta = cls.read_meta(root)
        for name, expected in meta["files"].items():
            path = root / name
            if not path.is_file():
                raise CheckpointError(f"{path}: missing from checkpoint; use an earlier checkpoint")
            if _sha256(path) != expected:
                raise CheckpointError(f"{path}: contents do not match meta.json (truncated or modified); "
                                      "refusing to load it, use an earlier checkpoint")
        return meta

    @classmethod
    def load(cls, save_dir: str | os.PathLike, map_location: str | torch.device = "cpu") -> "Checkpoint":
        root = Path(save_dir)
        meta = cls.verify(root)
        try:
            state = load_file(str(root / WEIGHTS_NAME), device=str(map_location))
            for alias, original in meta["aliases"].items():
                state[alias] = state[original]
            extra = {name: torch.load(root / f"{name}.pt", map_location=map_location, weights_only=True)
                     for name in meta["extra"]}
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors/pickle errors on a file that passed hashing: still the user's file
            raise CheckpointError(f"{root}: cannot be read ({exc})") from None
        return cls(state, meta["epoch"], meta["iteration"], extra, meta["meta"])


def list_checkpoints(ckpt_dir: str | os.PathLike, prefix: str = "step_") -> list[Path]:
    """Complete checkpoint directories under ``ckpt_dir``, oldest first (temporary ones skipped)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix) and (p / META_NAME).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Optional[Path]:
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def prune_checkpoints(ckpt_dir: str | os.PathLike, keep: int) -> None:
    for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
