"""Verifiable instruction following: checks a program can decide, no judge model.

Each record is a prompt plus a list of checks on the answer, in the spirit of
IFEval. Supported checks (JSON objects with a ``type``):

- ``{"type": "word_count", "min": 3, "max": 10}``: number of words (an English word,
  or one Chinese character) within the bounds (either bound optional);
- ``{"type": "include_keywords", "keywords": ["Paris"]}``: each keyword appears
  (case-insensitive);
- ``{"type": "exclude_keywords", "keywords": ["maybe"]}``: none appears;
- ``{"type": "language", "language": "zh" | "en"}``: the answer is mostly Chinese
  (over half its letters are CJK) or mostly not;
- ``{"type": "starts_with", "prefix": "..."}`` / ``{"type": "ends_with", "suffix": "..."}``
  (surrounding whitespace ignored);
- ``{"type": "max_chars", "max": 50}``.

File: JSONL of ``{"prompt": ..., "checks": [...]}`` (an optional ``"response"`` is
checked as is instead of generating).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from astrai.errors import DataError
from astrai.jsonl import iter_jsonl
from astrai.eval.rouge import rouge_tokens

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LETTER = re.compile(r"[^\W\d_]", re.UNICODE)


def count_words(text: str) -> int:
    return len(rouge_tokens(text))


def cjk_fraction(text: str) -> float:
    letters = _LETTER.findall(text)
    return sum(bool(_CJK.match(ch)) for ch in letters) / len(letters) if letters else 0.0


def _word_count(text: str, spec: dict) -> bool:
    n = count_words(text)
    return spec.get("min", 0) <= n <= spec.get("max", float("inf"))


def _include(text: str, spec: dict) -> bool:
    return all(k.lower() in text.lower() for k in spec["keywords"])


def _exclude(text: str, spec: dict) -> bool:
    return not any(k.lower() in text.lower() for k in spec["keywords"])


def _language(text: str, spec: dict) -> bool:
    chinese = cjk_fraction(text) > 0.5
    return chinese if spec["language"] == "zh" else (not chinese and bool(_LETTER.search(text)))


CHECKS: dict[str, tuple[Callable[[str, dict], bool], tuple[str, ...]]] = {
    "word_count": (_word_count, ()),
    "include_keywords": (_include, ("keywords",)),
    "exclude_keywords": (_exclude, ("keywords",)),
    "language": (_language, ("language",)),
    "starts_with": (lambda t, s: t.strip().startswith(s["prefix"]), ("prefix",)),
    "ends_with": (lambda t, s: t.strip().endswith(s["suffix"]), ("suffix",)),
    "max_chars": (lambda t, s: len(t.strip()) <= s["max"], ("max",)),
}


def validate_check(spec, where: str) -> None:
    if not isinstance(spec, dict) or spec.get("type") not in CHECKS:
        raise DataError(f"{where}: unknown check {spec!r}; known types: {', '.join(CHECKS)}")
    missing = [k for k in CHECKS[spec["type"]][1] if k not in spec]
    if missing:
        raise DataError(f"{where}: check '{spec['type']}' needs field(s) {', '.join(missing)}")
    if spec["type"] == "language" and spec["language"] not in ("zh", "en"):
        raise DataError(f"{where}: language must be 'zh' or 'en', got {spec['language']!r}")


def run_check(text: str, spec: dict) -> bool:
    return CHECKS[spec["type"]][0](text, spec)


def load_instructions(path: str | Path) -> list[dict]:
    records = []
    for where, record in iter_jsonl(path):
        if not isinstance(record, dict) or not isinstance(record.get("checks"), list) or not record["checks"]:
            raise DataError(f"{where}: expected an object with a non-empty 'checks' list")
        if "prompt" not in record and "response" not in record:
            raise DataError(f"{where}: needs a 'prompt' to generate from or a 'response' to check")
        for spec in record["checks"]:
            validate_check(spec, where)
        records.append(record)
    if not records:
        raise DataError(f"{path}: no records found")
    return records


def score_instructions(records: list[dict], responses: list[str]) -> dict:
    """Prompt-level accuracy (all checks pass), check-level accuracy, and per-type rates."""
    if len(records) != len(responses):
        raise DataError(f"{len(records)} instruction records but {len(responses)} responses")
    per_prompt, per_type = [], {}
    for record, response in zip(records, responses):
        results = [run_check(response, spec) for spec in record["checks"]]
        per_prompt.append(results)
        for spec, ok in zip(record["checks"], results):
            per_type.setdefault(spec["type"], []).append(ok)
    checks = [ok for results in per_prompt for ok in results]
    return {
        "prompt_accuracy": sum(all(r) for r in per_prompt) / len(per_prompt),
        "check_accuracy": sum(checks) / len(checks),
        "by_type": {t: sum(v) / len(v) for t, v in sorted(per_type.items())},
        "n": len(per_prompt),
    }
