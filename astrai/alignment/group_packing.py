"""One forward pass per shared prompt: the prompt once, its responses side by side behind it.

A GRPO group's responses, and a DPO pair's chosen and rejected answers, share their
prompt, and on a chat model the prompt (template, system text, question) is often ten
to twenty times longer than an answer. Laid out one row per response, the policy, the
reference and the backward pass run the prompt once per response. Packed, a row holds
the prompt once and then each response, with a mask that lets every response see the
prompt and its own earlier tokens and nothing of its siblings, and positions that
restart after the prompt for each response. Each response token is scored from the
position before it (the prompt's last position for a first token), so the log-probs are
those of the one-row-per-response layout, and logits are computed at those positions only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from astrai.alignment.losses import token_logprobs
from astrai.alignment.reference import unwrap


@dataclass
class PackedGroups:
    """Rows of ``prompt + response_1 + … + response_G`` and where each response token is scored.

    ``logits_index`` [B, K] is the position whose logits score each of a row's response
    tokens, ``targets`` [B, K] those tokens; ``gather`` [N, R] indexes the flattened
    [B·K] scores for response n's tokens in order, and ``mask`` [N, R] is 1 on real ones.
    """

    input_ids: torch.Tensor       # [B, T]
    position_ids: torch.Tensor    # [B, T]
    attention_mask: torch.Tensor  # [B, T, T], True where a query may see a key
    logits_index: torch.Tensor    # [B, K]
    targets: torch.Tensor         # [B, K]
    gather: torch.Tensor          # [N, R]
    mask: torch.Tensor            # [N, R]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device) -> "PackedGroups":
        return PackedGroups(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def split_rows(input_ids: torch.Tensor, response_mask: torch.Tensor,
               attention_mask: Optional[torch.Tensor] = None) -> Optional[tuple[list[list[int]], list[list[int]]]]:
    """(prompts, responses) of prompt+response rows: a row's prompt is what comes before its first
    response token (less the positions ``attention_mask`` marks as padding), its response the one
    run of tokens the mask marks; what follows the response cannot change its scores. None when
    a row's response is not one run (a token inside it that does not count is still context)."""
    prompts, responses = [], []
    attention = attention_mask.tolist() if attention_mask is not None else [None] * len(input_ids)
    for ids, mask, real in zip(input_ids.tolist(), response_mask.tolist(), attention):
        start = mask.index(1) if 1 in mask else len(mask)
        end = start + sum(mask)
        if any(mask[start:end]) and not all(mask[start:end]):
            return None
        prompts.append([t for i, t in enumerate(ids[:start]) if real is None or real[i]])
        responses.append(ids[start:end])
    return prompts, responses


def pack_groups(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> Optional[PackedGroups]:
    """Pack rows that share a prompt (identical token lists, anywhere in the batch) into one row each.

    Returns None when a response or a prompt is empty: a response token needs a
    position before it to be scored from.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    if any(len(p) == 0 for p in prompts) or any(len(r) == 0 for r in responses):
        return None
    groups: dict[tuple, list[int]] = {}
    for n, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(n)
    lengths = [len(key) + sum(len(responses[n]) for n in rows) for key, rows in groups.items()]
    scored = [sum(len(responses[n]) for n in rows) for rows in groups.values()]
    B, T, K = len(groups), max(lengths), max(scored)
    R = max(len(r) for r in responses)
    ids = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    allowed = torch.zeros(B, T, T, dtype=torch.bool)
    logits_index = torch.zeros(B, K, dtype=torch.long)
    targets = torch.zeros(B, K, dtype=torch.long)
    gather = torch.zeros(len(prompts), R, dtype=torch.long)
    mask = torch.zeros(len(prompts), R, dtype=torch.long)
    for b, (key, rows) in enumerate(groups.items()):
        P = len(key)
        ids[b, :P] = torch.tensor(key, dtype=torch.long)
        positions[b, :P] = torch.arange(P)
        allowed[b, :P, :P] = True  # causality is added by the model
        start, k = P, 0
        for n in rows:
            response = responses[n]
            end = start + len(response)
            ids[b, start:end] = torch.tensor(list(response), dtype=torch.long)
            positions[b, start:end] = torch.arange(P, P + len(response))
            allowed[b, start:end, :P] = True
            allowed[b, start:end, start:end] = True
            scored_from = torch.cat([torch.tensor([P - 1]), torch.arange(start, end - 1)])
            logits_index[b, k:k + len(response)] = scored_from
            targets[b, k:k + len(response)] = ids[b, start:end]
            gather[n, :len(response)] = torch.arange(b * K + k, b * K + k + len(response))
            mask[n, :len(response)] = 1
            start, k = end, k + len(response)
    return PackedGroups(ids, positions, allowed, logits_index, targets, gather, mask)


def model_max_len(model) -> int:
    """The longest row ``model`` takes (0 when its config does not say, so nothing is packed)."""
    return int(getattr(getattr(unwrap(model), "config", None), "max_len", 0) or 0)


def packed_rows(input_ids: torch.Tensor, response_mask: torch.Tensor, max_len: int,
                attention_mask: Optional[torch.Tensor] = None) -> Optional[PackedGroups]:
    """The rows packed by shared prompt when that fits ``max_len`` and is no longer than the rows
    themselves; None where the rows must be scored as they are."""
    rows = split_rows(input_ids, response_mask, attention_mask)
    packed = pack_groups(*rows) if rows is not None else None
    if packed is None or packed.length > max_len or packed.tokens > input_ids.numel():
        return None
    return packed


def packed_logprobs_and_aux(model, packed: PackedGroups) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p of each response token given its prompt and its own earlier tokens: [N, R] (0 where
    ``packed.mask`` is 0), and the model's MoE balancing loss (None for a dense model)."""
    out = model(packed.input_ids, input_mask=packed.attention_mask, position_ids=packed.position_ids,
                logits_index=packed.logits_index)
    scores = token_logprobs(out["logits"], packed.targets).flatten()
    return scores[packed.gather] * packed.mask.to(scores.dtype), out.get("aux_loss")
