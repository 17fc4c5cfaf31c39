"""The device tests reuse the inference, trainer and server tests' tiny models and data."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
for folder in ("inference", "trainer", "serving"):
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))
