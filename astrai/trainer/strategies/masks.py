"""Attention masks built from batch keys, shared by every strategy."""

from __future__ import annotations

from typing import Optional

import torch


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids of packed sequences → [B, T, T] bool (True = same document).

    The model ANDs this with causality, so a token sees only earlier tokens of its
    own document and packing never leaks context across documents.
    """
    return doc_ids[:, :, None] == doc_ids[:, None, :]


def model_inputs(batch: dict[str, torch.Tensor], ids_key: str = "input_ids") -> dict[str, Optional[torch.Tensor]]:
    """Keyword arguments for ``model(...)``: ids, the attention mask and position ids."""
    if "doc_ids" in batch:
        input_mask = document_mask(batch["doc_ids"])
    else:
        input_mask = batch.get("input_mask", batch.get("attention_mask"))
    return {"input_ids": batch[ids_key], "input_mask": input_mask, "position_ids": batch.get("position_ids")}
