#!/usr/bin/env bash
# Build (once; a second run returns at once) the cached bilingual pre-training corpus from
# Debian packages: `apt-get download` + `dpkg-deb -x`, no root needed. Tens of MB of English
# and Chinese text with each source's licence beside it, in ${ASTRAI_CACHE:-~/.cache/astrai}/corpus.
# Usage: scripts/build_large_corpus.sh [--out DIR] [--offline]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m astrai.dataset.corpus "$@"
