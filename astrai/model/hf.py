"""Hugging Face interchange (Llama, Qwen2, Qwen3, Mistral). Filled in by the HF interchange work."""

from __future__ import annotations

HF_FAMILIES: frozenset[str] = frozenset()


def load_hf_model(directory, raw_config, dtype=None, device="cpu"):
    raise NotImplementedError("Hugging Face import is not implemented yet")
