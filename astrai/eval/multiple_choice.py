"""Multiple choice in the MMLU format, scored by the likelihood of the answer letter.

Each question is rendered as the question, the four lettered choices and
``Answer:``; the model's next-token log-probabilities of the letters A–D (each
written as the tokenizer spells " A" … " D") decide its choice. Scoring one forward
pass per question, instead of generating, makes tiny models comparable: they need
not produce well-formed text to show what they know.

Files: MMLU's own CSV (no header: question, A, B, C, D, answer letter) or JSONL with
``{"question": ..., "choices": [4 strings], "answer": "B" | 1}`` and an optional
``"subject"``.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from astrai.errors import DataError

LETTERS = ("A", "B", "C", "D")


@dataclass
class Question:
    question: str
    choices: list[str]
    answer: int
    subject: str = ""


def _answer_index(value, where: str) -> int:
    if isinstance(value, bool):
        raise DataError(f"{where}: answer must be a letter A-D or an index 0-3, got {value!r}")
    if isinstance(value, int) and 0 <= value < 4:
        return value
    if isinstance(value, str) and value.strip().upper() in LETTERS:
        return LETTERS.index(value.strip().upper())
    raise DataError(f"{where}: answer must be a letter A-D or an index 0-3, got {value!r}")


def load_questions(path: str | Path) -> list[Question]:
    """Read an MMLU-format CSV or a JSONL file of questions."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    questions = _load_jsonl(path) if path.suffix == ".jsonl" else _load_csv(path)
    if not questions:
        raise DataError(f"{path}: no questions found")
    return questions


def _load_csv(path: Path) -> list[Question]:
    questions = []
    with path.open(newline="", encoding="utf-8") as handle:
        for line_no, row in enumerate(csv.reader(handle), start=1):
            if not row:
                continue
            where = f"{path}:{line_no}"
            if len(row) != 6:
                raise DataError(f"{where}: expected 6 columns (question, A, B, C, D, answer), got {len(row)}")
            questions.append(Question(row[0], row[1:5], _answer_index(row[5], where), subject=path.stem))
    return questions


def _load_jsonl(path: Path) -> list[Question]:
    questions = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object")
        for key in ("question", "choices", "answer"):
            if key not in record:
                raise DataError(f"{where}: missing field '{key}'")
        choices = record["choices"]
        if not (isinstance(choices, list) and len(choices) == 4 and all(isinstance(c, str) for c in choices)):
            raise DataError(f"{where}: 'choices' must be a list of 4 strings")
        questions.append(Question(str(record["question"]), choices, _answer_index(record["answer"], where),
                                  subject=str(record.get("subject", ""))))
    return questions


def format_question(q: Question) -> str:
    lines = [q.question.strip()]
    lines += [f"{letter}. {choice.strip()}" for letter, choice in zip(LETTERS, q.choices)]
    lines.append("Answer:")
    return "\n".join(lines)


def letter_token_ids(tokenizer) -> list[int]:
    """The token that starts " A", " B", " C", " D"; they must differ for scoring to mean anything."""
    ids = [tokenizer.encode(f" {letter}", add_special_tokens=False)[0] for letter in LETTERS]
    if len(set(ids)) != len(ids):
        raise DataError(f"the tokenizer spells the answer letters with overlapping first tokens {ids}; "
                        "multiple-choice scoring needs distinct letter tokens")
    return ids


@torch.no_grad()
def evaluate_multiple_choice(model, tokenizer, questions: list[Question]) -> dict:
    """Accuracy (overall and per subject) and the predicted letters."""
    letters = torch.tensor(letter_token_ids(tokenizer))
    device = next(model.parameters()).device
    max_len = model.config.max_len
    was_training = model.training
    model.eval()
    predictions = []
    try:
        for q in questions:
            ids = tokenizer.encode(format_question(q), add_special_tokens=False)[-max_len:]
            logits = model(torch.tensor([ids], device=device))["logits"][0, -1].float()
            letter_lp = F.log_softmax(logits, dim=-1)[letters.to(device)]
            predictions.append(int(letter_lp.argmax()))
    finally:
        model.train(was_training)
    correct = [p == q.answer for p, q in zip(predictions, questions)]
    by_subject: dict[str, list[bool]] = {}
    for q, ok in zip(questions, correct):
        by_subject.setdefault(q.subject or "all", []).append(ok)
    return {
        "accuracy": sum(correct) / len(correct),
        "n": len(correct),
        "by_subject": {s: sum(v) / len(v) for s, v in sorted(by_subject.items())},
        "predictions": [LETTERS[p] for p in predictions],
    }
