"""GenerateResult: collects the streamed tokens of several requests (the spec's name).

Each request appends (token, text piece) as it arrives; a consumer can drain the
interleaved pieces with ``pop_all`` (e.g. to print progress for a batch) or wait for
every request with ``wait_completion`` and read ``get_results``.
"""

from __future__ import annotations

import threading
from typing import Optional

from astrai.inference.types import StreamEvent


class GenerateResult:
    def __init__(self, n: int):
        self.tokens: list[tuple[int, str]] = []
        self.results: list[str] = [""] * n
        self._done = [False] * n
        self._cond = threading.Condition()

    def append(self, token: tuple[int, str], idx: int) -> None:
        """Record one token id and its text for request ``idx``."""
        with self._cond:
            self.tokens.append(token)
            self.results[idx] += token[1]
            self._cond.notify_all()

    def callback(self, idx: int):
        """A stream callback feeding request ``idx``'s events into this result."""
        def on_event(event: StreamEvent) -> None:
            with self._cond:
                for i, tok in enumerate(event.token_ids):
                    piece = event.text if i == len(event.token_ids) - 1 else ""
                    self.tokens.append((tok, piece))
                self.results[idx] += event.text
                if event.finished:
                    self._done[idx] = True
                self._cond.notify_all()
        return on_event

    def get_results(self) -> list[str]:
        with self._cond:
            return list(self.results)

    def pop_all(self) -> list[tuple[int, str]]:
        with self._cond:
            tokens, self.tokens = self.tokens, []
            return tokens

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until something new arrives or everything is done; True if anything is pending."""
        with self._cond:
            if not self.tokens and not all(self._done):
                self._cond.wait(timeout)
            return bool(self.tokens)

    def wait_completion(self, timeout: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(self._done), timeout)
