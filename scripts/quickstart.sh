#!/usr/bin/env bash
# The main job on one command: set up .venv, build the large pre-training corpus once
# (skipped, with a message, where Debian's archive cannot be reached: the run then uses the
# bundled sample), then run `astrai quickstart` with the flags given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m astrai.dataset.corpus || echo "quickstart: the large corpus could not be built; using the bundled sample"
exec .venv/bin/astrai quickstart "$@"
