"""The evaluation settings a model was scored with, kept beside its weights (``eval_config.json``).

A report's figures depend on how held-out text was windowed and how long answers could
grow, not only on the weights: the same model scored in windows of its whole ``max_len``
instead of the 256 tokens it trained on gives another perplexity. The quick start records
the settings it evaluated each model with in the model's directory, and ``astrai eval``
takes them as its defaults, so ``astrai eval --model DIR`` repeats the report's figures
without the user restating them; a flag still overrides each one.
"""

from __future__ import annotations

import json
from pathlib import Path

from astrai.errors import ConfigError

EVAL_CONFIG = "eval_config.json"
# Each setting the file may hold, with the least value it takes. A missing setting or null
# means astrai eval's own default (window: the model's max_len; stride: three quarters of the
# window; every token of each held-out file; the whole task pool; 48 new tokens).
LEAST = {"ppl_window": 1, "ppl_stride": 1, "ppl_max_tokens": 1, "task_problems": 0,
         "task_max_new_tokens": 1, "max_new_tokens": 1}


def save_eval_config(model_dir: str | Path, settings: dict) -> Path:
    """Write ``settings`` (names of LEAST) to ``model_dir``'s eval_config.json and return its path."""
    _check(settings, "settings")
    path = Path(model_dir) / EVAL_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return path


def load_eval_config(model_dir: str | Path) -> dict:
    """The settings recorded in ``model_dir`` ({} when it has no eval_config.json); a file
    that is not such a record is a ConfigError naming it."""
    path = Path(model_dir) / EVAL_CONFIG
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not JSON ({exc}); fix or delete it") from None
    _check(settings, str(path))
    return settings


def _check(settings, where: str) -> None:
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: expected a JSON object of evaluation settings, got {type(settings).__name__}")
    unknown = sorted(set(settings) - set(LEAST))
    if unknown:
        raise ConfigError(f"{where}: unknown evaluation setting(s) {', '.join(unknown)}; known: {', '.join(LEAST)}")
    for name, value in settings.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < LEAST[name]):
            raise ConfigError(f"{where}: {name} must be null or an integer >= {LEAST[name]}, got {value!r}")
