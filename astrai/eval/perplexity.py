"""Causal perplexity over long token streams with sliding windows.

A text longer than the model's window is scored window by window. Each window
starts ``stride`` tokens after the previous one and only the tokens not scored by
an earlier window count, so every token is predicted exactly once and always from
tokens *before* it (at least ``window_size - stride`` of them once the stream is
long enough). Nothing after a token ever enters its prediction: the model is
causal, and each window ends at the last token it scores.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from astrai.errors import ConfigError, DataError
from astrai.jsonl import iter_jsonl


@dataclass
class PerplexityResult:
    """Summed negative log-likelihood (nats) over ``tokens`` predicted tokens."""

    nll: float
    tokens: int

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_nll": self.mean_nll, "perplexity": self.perplexity}


def sliding_windows(n_tokens: int, window_size: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) for each window; the last ``n_scored`` tokens of
    ``ids[begin:end]`` are the ones this window predicts (the very first token of the
    stream has no context and is never scored)."""
    if window_size < 2:
        raise ConfigError(f"window_size must be >= 2, got {window_size}")
    if not 1 <= stride < window_size:
        # a window must overlap the previous one by a token, or its first token has no context
        raise ConfigError(f"stride must be in 1..window_size-1 ({window_size - 1}), got {stride}")
    windows = []
    scored_until = 1  # token 0 cannot be predicted
    begin = 0
    while scored_until < n_tokens:
        end = min(begin + window_size, n_tokens)
        windows.append((begin, end, end - scored_until))
        scored_until = end
        begin += stride
    return windows


def default_stride(window_size: int) -> int:
    """Three quarters of the window: each window after the first scores its last 3/4 with at least
    a quarter of a window as context (``astrai eval`` and the quick start's report both use it)."""
    return max(1, window_size - window_size // 4)


@torch.no_grad()
def token_nlls(model, token_ids: Sequence[int], window_size: int | None = None, stride: int | None = None,
               batch_size: int = 8) -> torch.Tensor:
    """-log p(ids[t] | earlier ids) for t = 1..n-1, as a float tensor of n-1 values."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    if ids.numel() < 2:
        raise DataError(f"perplexity needs at least 2 tokens, got {ids.numel()}")
    window_size = min(window_size or model.config.max_len, model.config.max_len)
    stride = min(stride or default_stride(window_size), window_size - 1)
    windows = sliding_windows(ids.numel(), window_size, stride)
    device = next(model.parameters()).device
    nlls = torch.empty(ids.numel() - 1)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(windows), batch_size):
            chunk = windows[start:start + batch_size]
            width = max(end - begin for begin, end, _ in chunk)
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, (begin, end, _) in enumerate(chunk):
                batch[row, :end - begin] = ids[begin:end]
                mask[row, :end - begin] = 1
            batch, mask = batch.to(device), mask.to(device)
            logits = model(batch, input_mask=None if bool(mask.all()) else mask)["logits"].float()
            target_lp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch[:, 1:, None]).squeeze(-1).cpu()
            for row, (begin, end, n_scored) in enumerate(chunk):
                # target_lp[row, j] predicts token begin+j+1; this window owns the last n_scored
                length = end - begin
                nlls[end - 1 - n_scored:end - 1] = -target_lp[row, length - 1 - n_scored:length - 1]
    finally:
        model.train(was_training)
    return nlls


def perplexity(model, token_ids: Sequence[int], window_size: int | None = None, stride: int | None = None,
               batch_size: int = 8) -> PerplexityResult:
    """Perplexity of ``model`` on one token stream (a list of ids)."""
    nlls = token_nlls(model, token_ids, window_size, stride, batch_size)
    return PerplexityResult(nll=float(nlls.double().sum()), tokens=nlls.numel())


def text_perplexity(model, tokenizer, text: str, window_size: int | None = None, stride: int | None = None,
                    batch_size: int = 8) -> PerplexityResult:
    """Perplexity of a text; the stream starts with the tokenizer's bos token when it has one,
    so the first word of the text is predicted too."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = getattr(tokenizer, "bos_id", None)
    if bos is not None:
        ids = [bos] + list(ids)
    return perplexity(model, ids, window_size=window_size, stride=stride, batch_size=batch_size)


def unigram_perplexity(token_ids: Sequence[int]) -> float:
    """Perplexity of the best unigram model *fitted on the same tokens* (exp of their
    empirical entropy). No unigram model does better on this text, so a language
    model below this number has learned more than token frequencies."""
    counts = Counter(int(t) for t in token_ids)
    total = sum(counts.values())
    if total == 0:
        raise DataError("unigram perplexity of an empty token stream is undefined")
    entropy = -sum(c / total * math.log(c / total) for c in counts.values())
    return math.exp(entropy)


def read_documents(path: str | Path) -> list[str]:
    """Held-out text: a .txt file is one document; a .jsonl file has one ``{"text": ...}`` per line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8")]
    docs = []
    for where, record in iter_jsonl(path):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{where}: expected an object with a string 'text' field")
        docs.append(record["text"])
    if not docs:
        raise DataError(f"{path}: no documents found")
    return docs


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    """Summed negative log-likelihood (nats) per UTF-8 byte of the scored text, in bits:
    unlike perplexity per token it does not depend on the tokenizer, so models with
    different vocabularies (or none) compare on it."""
    if n_bytes <= 0:
        raise DataError(f"bits per byte needs scored text, got {n_bytes} bytes")
    return nll_nats / (n_bytes * math.log(2))


def heldout_perplexity(model, tokenizer, path: str | Path, window_size: int | None = None,
                       stride: int | None = None, max_tokens: int | None = None) -> dict:
    """Perplexity over every document of a held-out file (each scored on its own, from its
    bos token), beside the unigram baseline of the same scored tokens, and the same
    likelihood as bits per UTF-8 byte of the scored text.

    ``max_tokens`` stops after that many scored tokens (whole documents) to bound the cost.
    """
    nll, scored, n_bytes = 0.0, [], 0
    bos = getattr(tokenizer, "bos_id", None)
    for doc in read_documents(path):
        ids = tokenizer.encode(doc, add_special_tokens=False)
        if not ids:
            continue
        result = perplexity(model, ([bos] if bos is not None else []) + list(ids), window_size, stride)
        nll += result.nll
        scored += list(ids) if bos is not None else list(ids[1:])
        # without a bos the first token is context, not scored: its bytes do not count either
        n_bytes += len(doc.encode("utf-8")) - (0 if bos is not None else len(tokenizer.decode(ids[:1]).encode("utf-8")))
        if max_tokens is not None and len(scored) >= max_tokens:
            break
    if not scored:
        raise DataError(f"{path}: no text to score")
    ppl = math.exp(nll / len(scored))
    return {"perplexity": ppl, "mean_nll": nll / len(scored), "tokens": len(scored), "bytes": n_bytes,
            "bits_per_byte": bits_per_byte(nll, n_bytes), "unigram_perplexity": unigram_perplexity(scored)}
