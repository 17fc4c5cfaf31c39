"""Progress of a long command, phase by phase, on stderr (stdout stays for results).

On a terminal each phase is a tqdm bar. Elsewhere (a pipe, a log file, a CI job) a bar's
carriage returns turn into noise, so a phase writes one line when it starts and one when
it ends, with what it did and how long it took.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from tqdm import tqdm


def on_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Phase:
    """One phase of a long job (``with Phase("quantize", total=30, unit="linear") as step: ... step(1)``)."""

    def __init__(self, name: str, total: Optional[int] = None, unit: str = "it", stream: Optional[TextIO] = None,
                 unit_scale: bool = False, show: bool = True):
        """``unit_scale`` writes counts the way tqdm's option of that name does (2.35MB for bytes);
        ``show`` False counts without a word (for a caller that reports in its own way)."""
        self.name, self.total, self.unit, self.unit_scale, self.show = name, total, unit, unit_scale, show
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.bar: Optional[tqdm] = None
        self.started = 0.0

    def __enter__(self) -> "Phase":
        self.started = time.perf_counter()
        if not self.show:
            return self
        if on_terminal(self.stream):
            self.bar = tqdm(total=self.total, desc=self.name, unit=self.unit, file=self.stream, dynamic_ncols=True,
                            leave=True, unit_scale=self.unit_scale)
        else:
            size = f" ({self.count(self.total)})" if self.total is not None else ""
            print(f"{self.name}{size} ...", file=self.stream, flush=True)
        return self

    def count(self, n: int) -> str:
        return f"{tqdm.format_sizeof(n)}{self.unit}" if self.unit_scale else f"{n} {self.unit}"

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def __exit__(self, kind, value, traceback) -> None:
        if self.bar is not None:
            self.bar.close()
            return
        if kind is None and self.show:
            count = f"{self.count(self.done)}, " if self.done else ""
            print(f"{self.name}: done ({count}{time.perf_counter() - self.started:.1f} s)", file=self.stream, flush=True)
