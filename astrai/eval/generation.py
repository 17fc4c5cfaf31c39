"""Batched greedy decoding for evaluations.

Evaluations need answers that do not depend on luck, so they decode greedily. This
loop recomputes the whole (left-padded) batch each step instead of keeping a KV
cache: for the short answers of the bundled tasks on a tiny model that costs little
and keeps the evaluation independent of the serving engine. ``engine_generator``
wraps an ``InferenceEngine`` instead when one is at hand (faster on long outputs).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Generator = Callable[[Sequence[str]], list[str]]


def chat_prompt(tokenizer, user_text: str) -> str:
    """The user turn rendered with the model's chat template, ready for the assistant's answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True)


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 32,
                    batch_size: int = 16) -> list[str]:
    """Greedy continuation of each prompt (text in, decoded text out), stopping at the
    tokenizer's stop ids or after ``max_new_tokens``."""
    device = next(model.parameters()).device
    stop_ids = set(getattr(tokenizer, "stop_ids", None) or [tokenizer.eos_id])
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    max_len = model.config.max_len
    was_training = model.training
    model.eval()
    outputs: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            encoded = [tokenizer.encode(p, add_special_tokens=False)[-(max_len - max_new_tokens):]
                       for p in prompts[start:start + batch_size]]
            outputs.extend(_greedy_batch(model, encoded, max_new_tokens, stop_ids, pad_id, device, tokenizer))
    finally:
        model.train(was_training)
    return outputs


def _greedy_batch(model, encoded: list[list[int]], max_new_tokens: int, stop_ids: set[int], pad_id: int,
                  device, tokenizer) -> list[str]:
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for row, e in enumerate(encoded):  # left padding: every row's next token sits in the last column
        ids[row, width - len(e):] = torch.tensor(e, dtype=torch.long)
        mask[row, width - len(e):] = 1
    ids, mask = ids.to(device), mask.to(device)
    generated: list[list[int]] = [[] for _ in encoded]
    done = [False] * len(encoded)
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, input_mask=mask, position_ids=positions)["logits"][:, -1]
        next_ids = logits.argmax(-1)
        for row, token in enumerate(next_ids.tolist()):
            if done[row]:
                continue
            if token in stop_ids:
                done[row] = True
            else:
                generated[row].append(token)
        if all(done):
            break
        ids = torch.cat([ids, next_ids[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return [tokenizer.decode(g, skip_special_tokens=True) for g in generated]


def model_generator(model, tokenizer, max_new_tokens: int = 32, batch_size: int = 16) -> Generator:
    """A Generator over ``greedy_generate``."""
    return lambda prompts: greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size)


def engine_generator(engine, max_new_tokens: int = 32, chunk: int = 128) -> Generator:
    """A Generator that decodes greedily through an ``InferenceEngine``, ``chunk`` prompts
    submitted at a time: enough to keep its batch full, never more than its queue holds."""
    def generate(prompts: Sequence[str]) -> list[str]:
        prompts = list(prompts)
        return [text for start in range(0, len(prompts), chunk)
                for text in engine.generate(prompts[start:start + chunk], max_tokens=max_new_tokens, temperature=0.0)]

    return generate
