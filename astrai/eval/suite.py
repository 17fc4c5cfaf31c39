"""One call that runs the chosen evaluations on a model and returns a JSON-ready dict.

``astrai eval`` and the quick start both go through ``evaluate``; each section of the
result is present only when its evaluation was asked for, so a report can tell "not
run" from "scored zero".
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

from astrai.errors import ConfigError
from astrai.eval.generation import Generator, chat_prompt, model_generator
from astrai.eval.instructions import load_instructions, score_instructions
from astrai.eval.multiple_choice import evaluate_multiple_choice, load_questions
from astrai.eval.perplexity import heldout_perplexity
from astrai.eval.rouge import corpus_rouge, load_references
from astrai.eval.samples import sample_answers
from astrai.eval.task_accuracy import task_accuracy
from astrai.progress import Phase

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DEFAULT_HELDOUT = {"en": DATA_DIR / "pretrain" / "valid_en.jsonl", "zh": DATA_DIR / "pretrain" / "valid_zh.jsonl"}


def evaluate(model, tokenizer, *, heldout: Optional[dict[str, str | Path]] = None,
             ppl_window: Optional[int] = None, ppl_stride: Optional[int] = None, ppl_max_tokens: Optional[int] = None,
             task: Optional[tuple[Sequence, Callable, Callable]] = None, samples: bool = False,
             mmlu: Sequence[str | Path] = (), rouge: Optional[str | Path] = None,
             instructions: Optional[str | Path] = None, chat: bool = True, max_new_tokens: int = 32,
             task_max_new_tokens: Optional[int] = None, generator: Optional[Generator] = None,
             progress: bool = False) -> dict:
    """Run the evaluations given and return their results.

    ``heldout`` maps a name (``en``, ``zh``) to a held-out text file, scored in windows of
    ``ppl_window`` tokens (default the model's ``max_len``) every ``ppl_stride`` (default
    ``default_stride``); ``task`` is ``(problems, prompt_of, check)``; ``chat`` says whether
    prompts go through the chat template (False for a pre-trained model that never saw it).
    Answers are greedy, up to ``max_new_tokens``; the task's up to ``task_max_new_tokens``
    when given (its answers are a number, the samples' are sentences). A ``generator``
    decodes everything instead, with its own length.
    ``progress`` shows each evaluation as a phase on stderr (astrai/progress.py).
    """
    if generator is not None and task_max_new_tokens is not None:
        raise ConfigError("evaluate: task_max_new_tokens applies to the built-in greedy decoding; "
                          "a generator decides its own answer length")
    generate = generator or model_generator(model, tokenizer, max_new_tokens)
    solve = model_generator(model, tokenizer, task_max_new_tokens) if task_max_new_tokens is not None else generate
    results: dict = {}
    started = time.perf_counter()
    phase = partial(Phase, show=progress)
    if heldout:
        results["perplexity"] = {}
        for name, path in heldout.items():
            with phase(f"perplexity {name}"):
                results["perplexity"][name] = heldout_perplexity(model, tokenizer, path, ppl_window, ppl_stride,
                                                                 ppl_max_tokens)
    if task is not None:
        problems, prompt_of, check = task
        with phase("task", total=len(problems), unit="problem") as step:
            results["task"] = task_accuracy(solve, tokenizer, problems, prompt_of, check, chat=chat)
            step(len(problems))
    if samples:
        with phase("samples"):
            results["samples"] = sample_answers(generate, tokenizer, chat=chat)
    if mmlu:
        with phase("mmlu"):
            questions = [q for path in mmlu for q in load_questions(path)]
            results["mmlu"] = evaluate_multiple_choice(model, tokenizer, questions)
    if rouge is not None:
        with phase("rouge"):
            records = load_references(rouge)
            predictions = _answers(generate, tokenizer, records, "prediction", chat)
            results["rouge"] = {**corpus_rouge(predictions, [r["reference"] for r in records]), "n": len(records)}
    if instructions is not None:
        with phase("instructions"):
            records = load_instructions(instructions)
            responses = _answers(generate, tokenizer, records, "response", chat)
            results["instructions"] = score_instructions(records, responses)
    results["seconds"] = time.perf_counter() - started
    return results


def _answers(generate: Generator, tokenizer, records: list[dict], given_key: str, chat: bool) -> list[str]:
    """The given answers where records carry them, generated ones for the rest."""
    todo = [i for i, r in enumerate(records) if given_key not in r]
    prompts = [chat_prompt(tokenizer, records[i]["prompt"]) if chat else records[i]["prompt"] for i in todo]
    generated = dict(zip(todo, generate(prompts))) if todo else {}
    return [r[given_key] if given_key in r else generated[i] for i, r in enumerate(records)]
