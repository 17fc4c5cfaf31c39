"""Recognising a GGUF file by its name or first bytes, without importing the GGUF reader.

The check sits apart from astrai/model/gguf.py (which imports numpy, the ``gguf`` package and
torch) so that a tokenizer or CLI verb handed a path can tell a GGUF file from a directory
at no start-up cost."""

from __future__ import annotations

import os
from pathlib import Path

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a path named ``*.gguf`` (so a missing one is reported as such) or a file starting with the GGUF magic."""
    path = Path(path)
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC
