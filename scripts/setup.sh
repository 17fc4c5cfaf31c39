#!/usr/bin/env bash
# Create .venv in the checkout and install astrai into it (torch==2.13.0 first).
# Usage: scripts/setup.sh [extra]   e.g. scripts/setup.sh test
# Safe to run twice: it reinstalls only when pyproject.toml or the extra changed.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="${1:-}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
fi
STAMP=".venv/.astrai-installed${EXTRA:+-$EXTRA}"
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "setup: installing astrai${EXTRA:+[$EXTRA]} and its dependencies"
  "$PY" -m pip install -q --disable-pip-version-check -e ".${EXTRA:+[$EXTRA]}"
  echo "$WANT" > "$STAMP"
fi
