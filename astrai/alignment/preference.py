"""Reading a preference batch (chosen/rejected ids and response masks), shared by DPO and the reward model.

A batch may also carry ``chosen_attention_mask``/``rejected_attention_mask`` (1 on real
tokens): padding anywhere, left-padding from a user's own collate function included, is
then masked out and each row scores exactly as it would alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.errors import DataError

PREFERENCE_KEYS = ("chosen", "rejected", "chosen_mask", "rejected_mask")


def check_preference_batch(batch: dict, train_type: str) -> None:
    """Raise DataError naming the missing key or the pair whose response is empty."""
    missing = [k for k in PREFERENCE_KEYS if k not in batch]
    if missing:
        raise DataError(f"{train_type} batch has no {', '.join(repr(k) for k in missing)}; each preference record "
                        f"needs a prompt, a 'chosen' and a 'rejected' answer (load the data with train_type 'dpo')")
    for side in ("chosen", "rejected"):
        empty = (batch[f"{side}_mask"].sum(dim=1) == 0).nonzero().flatten().tolist()
        if empty:
            raise DataError(f"{train_type} batch: pair(s) {empty} have an empty {side} response (its mask is all 0); "
                            f"every record needs a non-empty '{side}' answer")
        attention = batch.get(f"{side}_attention_mask")
        if attention is None:
            continue
        if attention.shape != batch[side].shape:
            raise DataError(f"{train_type} batch: {side}_attention_mask has shape {tuple(attention.shape)} but "
                            f"{side} has {tuple(batch[side].shape)}")
        padded = ((batch[f"{side}_mask"] != 0) & (attention == 0)).any(dim=1).nonzero().flatten().tolist()
        if padded:
            raise DataError(f"{train_type} batch: pair(s) {padded} mark padding (attention mask 0) as part of the "
                            f"{side} response")


def _pad_to(t: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(t, (0, length - t.shape[1])) if t.shape[1] < length else t


def stack_pairs(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen rows then rejected rows in one right-padded tensor, so both take one forward pass.

    The padding value is irrelevant: the response masks (0 there) decide what counts,
    and causal attention keeps padding at the end from affecting real tokens.
    """
    length = max(batch["chosen"].shape[1], batch["rejected"].shape[1])
    ids = torch.cat([_pad_to(batch["chosen"], length), _pad_to(batch["rejected"], length)])
    mask = torch.cat([_pad_to(batch["chosen_mask"], length), _pad_to(batch["rejected_mask"], length)])
    return ids, mask


def stack_attention(batch: dict) -> torch.Tensor | None:
    """The attention masks in ``stack_pairs``' layout, or None when the batch has none (no padding
    inside a row: right padding after the response cannot affect it under causal attention)."""
    if "chosen_attention_mask" not in batch and "rejected_attention_mask" not in batch:
        return None
    length = max(batch["chosen"].shape[1], batch["rejected"].shape[1])
    sides = [batch.get(f"{side}_attention_mask", torch.ones_like(batch[side])) for side in ("chosen", "rejected")]
    return torch.cat([_pad_to(mask, length) for mask in sides])
