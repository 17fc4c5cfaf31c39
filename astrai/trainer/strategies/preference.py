"""Reading a preference batch (chosen/rejected ids and response masks), shared by DPO and the reward model."""

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
