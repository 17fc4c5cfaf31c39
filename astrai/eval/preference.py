"""Preference accuracy on held-out pairs: does the model find the chosen answer likelier?

DPO's loss rewards a policy whose log-likelihood ratio (against a reference) favours the
chosen answer; what it should leave behind, judged without the reference, is a model that
gives the chosen answer of a pair it never trained on more likelihood than the rejected
one. This counts the pairs where it does, with the 95% Wilson interval, and the mean margin
(chosen minus rejected log-likelihood, in nats) with its 95% interval. Each pair's margin
is kept, so that a stage can be compared with the stage before it pair by pair: on pairs a
model already gets right, the margin is what preference training can still move.
"""

from __future__ import annotations

from typing import Sequence

import torch

from astrai.alignment.losses import sequence_logprobs
from astrai.eval.generation import chat_prompt
from astrai.eval.intervals import mean_interval, wilson_interval


@torch.no_grad()
def answer_logprob(model, tokenizer, prompt: str, answer: str) -> float:
    """Sum of the log-probabilities of ``answer``'s tokens after ``prompt``."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    ids = torch.tensor([prompt_ids + answer_ids], device=next(model.parameters()).device)
    answer_mask = torch.zeros_like(ids)
    answer_mask[0, len(prompt_ids):] = 1
    return sequence_logprobs(model, ids, answer_mask).item()


def preference_accuracy(model, tokenizer, pairs: Sequence[dict], chat: bool = True, n_examples: int = 3) -> dict:
    """``pairs``: ``{"prompt": [messages] | str, "chosen": str, "rejected": str}``; the prompt
    goes through the chat template when ``chat`` (a one-turn user message), else it is text
    followed by a space."""
    was_training = model.training
    model.eval()
    margins = []
    try:
        for pair in pairs:
            prompt = pair["prompt"] if isinstance(pair["prompt"], str) else pair["prompt"][-1]["content"]
            text = chat_prompt(tokenizer, prompt) if chat else prompt + " "
            margins.append(answer_logprob(model, tokenizer, text, pair["chosen"])
                           - answer_logprob(model, tokenizer, text, pair["rejected"]))
    finally:
        model.train(was_training)
    preferred = sum(m > 0 for m in margins)
    return {
        "accuracy": preferred / len(margins),
        "interval": list(wilson_interval(preferred, len(margins))),
        "mean_margin": sum(margins) / len(margins),
        "margin_interval": list(mean_interval(margins)) if len(margins) >= 2 else None,
        "margins": margins,
        "n": len(margins),
        "examples": [{"chosen": p["chosen"], "rejected": p["rejected"], "margin": m}
                     for p, m in list(zip(pairs, margins))[:n_examples]],
    }
