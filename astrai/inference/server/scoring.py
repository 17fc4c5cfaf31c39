"""Log-probabilities of a prompt's own tokens, for ``echo`` with ``logprobs`` on ``/v1/completions``.

Evaluation harnesses score a multiple-choice answer or a text's perplexity by sending
context + continuation as the prompt and reading back how likely each prompt token
was. The engine's steps compute only the logits that sampling needs, so scoring asks the
engine for one plain forward over the whole prompt (``prompt_logits``), which it runs
between its steps and weight updates.
"""

from __future__ import annotations

import torch

from astrai.inference.types import TokenLogprob


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else ""


def score_prompt(engine, prompt_ids: list[int], n_top: int) -> list[TokenLogprob]:
    """One entry per prompt token after the first (which has no context to be scored in).

    Each carries the token's log-probability given the tokens before it and the ``n_top``
    most likely tokens at that position, as a generated token's logprobs do."""
    logprobs = engine.prompt_logits(prompt_ids)[:-1].float().log_softmax(dim=-1)
    targets = torch.tensor(prompt_ids[1:], device=logprobs.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if n_top:
        top_values, top_ids = logprobs.topk(n_top, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    tokenizer = engine.tokenizer
    entries = []
    for i, token in enumerate(prompt_ids[1:]):
        top = [(t, token_text(tokenizer, t), v) for t, v in zip(top_ids[i], top_values[i])] if n_top else []
        entries.append(TokenLogprob(token_id=token, text=token_text(tokenizer, token), logprob=chosen[i], top=top))
    return entries
