"""StopChecker: end generation at a stop string without ever emitting any part of it.

Text arrives in pieces; a piece may end with the beginning of a stop string ("<" of
"</answer>"). That tail is held back until the next pieces either complete the stop
string (generation ends, the stop text is dropped) or rule it out (the tail is
released). The concatenation of everything released equals the generated text cut
just before the first stop string.
"""

from __future__ import annotations

from typing import Optional, Sequence


class StopChecker:
    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, Optional[str]]:
        """Add text; return (text safe to emit now, the stop string matched or None)."""
        if not self.stop:
            return text, None
        buffer = self._held + text
        first, matched = -1, None
        for s in self.stop:
            i = buffer.find(s)
            if i != -1 and (first == -1 or i < first):
                first, matched = i, s
        if matched is not None:
            self._held = ""
            return buffer[:first], matched
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buffer)), hold, -1):
                if buffer.endswith(s[:k]):
                    hold = k
                    break
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold], None

    def flush(self) -> str:
        """Generation ended for another reason: the held tail was never a stop string."""
        held, self._held = self._held, ""
        return held
