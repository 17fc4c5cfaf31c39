"""Reading JSONL files that users hand us, with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from astrai.errors import DataError


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, record)`` for each non-blank line, ``where`` being ``file:line``.

    A missing file or a line that is not JSON raises DataError naming the place, so every
    reader of user files reports problems the same way; checking the record's shape is
    left to the caller, which knows what it expects.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
