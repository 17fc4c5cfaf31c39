"""Evaluation: causal perplexity, checkable-task accuracy, sample answers, multiple
choice (MMLU format), ROUGE and instruction-following checks; ``evaluate`` runs any
mix of them and returns one JSON-ready dict (``astrai eval`` on the command line)."""

from astrai.eval.instructions import run_check, score_instructions
from astrai.eval.multiple_choice import evaluate_multiple_choice, load_questions
from astrai.eval.perplexity import heldout_perplexity, perplexity, token_nlls, unigram_perplexity
from astrai.eval.rouge import corpus_rouge, rouge_scores
from astrai.eval.suite import DEFAULT_HELDOUT, evaluate
from astrai.eval.task_accuracy import arithmetic_task, task_accuracy

__all__ = ["DEFAULT_HELDOUT", "arithmetic_task", "corpus_rouge", "evaluate", "evaluate_multiple_choice",
           "heldout_perplexity", "load_questions", "perplexity", "rouge_scores", "run_check", "score_instructions",
           "task_accuracy", "token_nlls", "unigram_perplexity"]
