"""Stop strings over streamed text: the one checker the engine's tasks and the server share.

A stop string can arrive split across several tokens, so text that might be the
start of one is held back until it is either completed (generation stops, the stop
string and everything after it are dropped) or ruled out (the text is released).
The concatenation of everything released equals the generated text cut just before
the first stop string.
"""

from __future__ import annotations

from typing import Optional


class StopChecker:
    """Incremental stop-string matcher: ``push`` text in, get releasable text out."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: Optional[str] = None

    def check(self, text: str) -> Optional[str]:
        """The stop string that occurs earliest in ``text`` (longest wins a tie), or None."""
        best: Optional[tuple[int, int, str]] = None
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (best is None or (at, -len(stop)) < (best[0], -best[1])):
                best = (at, len(stop), stop)
        return None if best is None else best[2]

    @staticmethod
    def trim(text: str, matched: str) -> str:
        """``text`` up to (not including) the first occurrence of ``matched``."""
        at = text.find(matched)
        return text if at < 0 else text[:at]

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def push(self, text: str) -> str:
        """Add new text; return the part that can no longer become a stop string.

        After a match, ``matched`` is set and the returned text ends just before it;
        further pushes return nothing.
        """
        if self.matched is not None:
            return ""
        buffer = self._held + text
        matched = self.check(buffer)
        if matched is not None:
            self.matched = matched
            self._held = ""
            return self.trim(buffer, matched)
        keep = self._held_suffix_len(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release held-back text at the end of generation (it never completed a stop)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
