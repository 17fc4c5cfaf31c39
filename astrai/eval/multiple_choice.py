"""Multiple choice in the MMLU format, scored by the likelihood of the answer letter.

Each question is rendered as the question, the four lettered choices and
``Answer:``; the log-likelihood of each letter as the continuation (" A" … " D", as
the tokenizer spells them: one token in a large vocabulary, where this is the
next-token probability of the letter, a few tokens in a small one) decides the
model's choice. Scoring likelihoods instead of generating makes tiny models
comparable: they need not produce well-formed text to show what they know.

Files: MMLU's own CSV (no header: question, A, B, C, D, answer letter) or JSONL with
``{"question": ..., "choices": [4 strings], "answer": "B" | 1}`` and an optional
``"subject"``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from astrai.errors import DataError
from astrai.jsonl import iter_jsonl

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
    for where, record in iter_jsonl(path):
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


def letter_token_ids(tokenizer) -> list[list[int]]:
    """How the tokenizer spells " A", " B", " C", " D"; they must differ for scoring to mean anything."""
    ids = [tokenizer.encode(f" {letter}", add_special_tokens=False) for letter in LETTERS]
    if len({tuple(i) for i in ids}) != len(ids) or not all(ids):
        raise DataError(f"the tokenizer spells the answer letters as {ids}; multiple-choice scoring needs "
                        "four distinct, non-empty spellings")
    return ids


@torch.no_grad()
def letter_logprobs(model, prompt_ids: list[int], letters: list[list[int]]) -> torch.Tensor:
    """log p(letter | prompt) for each letter's tokens, from one batch of four rows."""
    device = next(model.parameters()).device
    width = len(prompt_ids) + max(len(l) for l in letters)
    batch = torch.zeros(len(letters), width, dtype=torch.long)
    for row, letter in enumerate(letters):
        batch[row, :len(prompt_ids) + len(letter)] = torch.tensor(prompt_ids + letter)
    logprobs = F.log_softmax(model(batch.to(device))["logits"].float(), dim=-1).cpu()  # right padding: causal, harmless
    scores = torch.zeros(len(letters))
    for row, letter in enumerate(letters):
        for k, token in enumerate(letter):  # the token at position len(prompt)+k is predicted one step earlier
            scores[row] += logprobs[row, len(prompt_ids) + k - 1, token]
    return scores


def evaluate_multiple_choice(model, tokenizer, questions: list[Question]) -> dict:
    """Accuracy (overall and per subject) and the predicted letters."""
    letters = letter_token_ids(tokenizer)
    budget = model.config.max_len - max(len(l) for l in letters)
    was_training = model.training
    model.eval()
    predictions = []
    try:
        for q in questions:
            ids = tokenizer.encode(format_question(q), add_special_tokens=False)[-budget:]
            predictions.append(int(letter_logprobs(model, ids, letters).argmax()))
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
