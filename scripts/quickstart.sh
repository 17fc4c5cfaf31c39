#!/usr/bin/env bash
# The main job on one command: set up .venv, then run `astrai quickstart`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/astrai quickstart "$@"
