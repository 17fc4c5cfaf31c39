"""ROUGE-1, ROUGE-2 and ROUGE-L, tokenised so Chinese and English both count fairly.

Chinese has no spaces, so each CJK character is a token; English (and any other
Latin-script run) is lower-cased and split into words of letters and digits.
Punctuation is dropped. Scores are F1 (with precision and recall alongside); with
several references the best-matching reference counts, as in the original ROUGE.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from astrai.errors import DataError
from astrai.jsonl import iter_jsonl

_TOKEN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|[^\W_]+", re.UNICODE)
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def rouge_tokens(text: str) -> list[str]:
    """CJK characters one by one, other words whole, lower-cased, punctuation dropped."""
    tokens = []
    for match in _TOKEN.finditer(text.lower()):
        piece = match.group()
        if len(piece) > 1 and _CJK.search(piece):  # a word mixing scripts: split its CJK characters out
            tokens += [t for t in re.split(f"({_CJK.pattern})", piece) if t]
        else:
            tokens.append(piece)
    return tokens


def _prf(overlap: int, n_candidate: int, n_reference: int) -> dict[str, float]:
    precision = overlap / n_candidate if n_candidate else 0.0
    recall = overlap / n_reference if n_reference else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def rouge_n(candidate: str, reference: str, n: int) -> dict[str, float]:
    cand, ref = _ngrams(rouge_tokens(candidate), n), _ngrams(rouge_tokens(reference), n)
    return _prf(sum((cand & ref).values()), sum(cand.values()), sum(ref.values()))


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, one row kept)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l(candidate: str, reference: str) -> dict[str, float]:
    cand, ref = rouge_tokens(candidate), rouge_tokens(reference)
    return _prf(lcs_length(cand, ref), len(cand), len(ref))


def rouge_scores(candidate: str, references: str | list[str]) -> dict[str, dict[str, float]]:
    """ROUGE-1/2/L of one candidate; each metric takes its best reference."""
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise DataError("ROUGE needs at least one reference")
    metrics = {
        "rouge1": lambda r: rouge_n(candidate, r, 1),
        "rouge2": lambda r: rouge_n(candidate, r, 2),
        "rougeL": lambda r: rouge_l(candidate, r),
    }
    return {name: max((fn(r) for r in refs), key=lambda s: s["f1"]) for name, fn in metrics.items()}


def corpus_rouge(candidates: list[str], references: list[str | list[str]]) -> dict[str, float]:
    """Mean F1 of each metric over candidate/reference pairs."""
    if len(candidates) != len(references):
        raise DataError(f"{len(candidates)} candidates but {len(references)} references")
    if not candidates:
        raise DataError("ROUGE over an empty set of candidates is undefined")
    per_item = [rouge_scores(c, r) for c, r in zip(candidates, references)]
    return {name: sum(s[name]["f1"] for s in per_item) / len(per_item) for name in ("rouge1", "rouge2", "rougeL")}


def load_references(path: str | Path) -> list[dict]:
    """JSONL of ``{"prompt": ..., "reference": str | [str, ...]}`` (plus an optional
    ``"prediction"``: when present it is scored as is, without generating)."""
    records = []
    for where, record in iter_jsonl(path):
        if not isinstance(record, dict) or "reference" not in record:
            raise DataError(f"{where}: expected an object with a 'reference' field")
        if "prompt" not in record and "prediction" not in record:
            raise DataError(f"{where}: needs a 'prompt' to generate from or a 'prediction' to score")
        records.append(record)
    if not records:
        raise DataError(f"{path}: no records found")
    return records
