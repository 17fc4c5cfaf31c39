#!/usr/bin/env bash
# Set up .venv with the test extra (and headless Chromium for the chat-page test), then run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  echo "test: installing Debian's chromium and chromium-driver for the browser test"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  { $SUDO apt-get update -qq >/dev/null &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; } ||
    echo "test: could not install chromium; the chat-page browser test will fail" >&2
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -n 2 -q "$@"
