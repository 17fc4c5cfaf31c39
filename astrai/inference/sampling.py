"""Sampling: logits → next token, with every parameter allowed to differ per row.

The strategies follow the spec's pipeline (Temperature → TopK → TopP, plus MinP):
each takes logits [B, V] and returns them with filtered entries set to
``filter_value``. A parameter may be a Python number (same for all rows) or a
tensor [B] (one per row), so one batched call serves requests with different
settings. Drawing uses the exponential race (argmax of p / Exp(1) noise), drawn from
each seeded request's own ``torch.Generator``, so a seeded request samples the same tokens
whoever shares its batch. A filtered token has probability exactly 0 and can never
be drawn.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence, Union

import torch

Param = Union[float, int, torch.Tensor]
NEG_INF = float("-inf")


def _per_row(value: Param, logits: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar, a one-row or a [B] parameter to a [B, 1] tensor on the logits' device
    (one row's settings apply to every row: a verify step's positions of one request)."""
    t = torch.as_tensor(value, device=logits.device)
    if t.numel() == 1:
        t = t.reshape(()).expand(logits.shape[0])
    return t.view(-1, 1)


class BaseSamplingStrategy(ABC):
    @abstractmethod
    def apply(self, logits: torch.Tensor, filter_value: float = NEG_INF) -> torch.Tensor:
        """Return transformed logits [B, V]."""


class TemperatureStrategy(BaseSamplingStrategy):
    """Divide by temperature; rows with temperature 0 (greedy) are left as they are."""

    def __init__(self, temperature: Param):
        self.temperature = temperature

    def apply(self, logits, filter_value=NEG_INF):
        t = _per_row(self.temperature, logits).to(logits.dtype)
        return logits / torch.where(t > 0, t, torch.ones_like(t))


class TopKStrategy(BaseSamplingStrategy):
    """Keep the k highest logits per row (k = 0 keeps all)."""

    def __init__(self, top_k: Param):
        self.top_k = top_k

    def apply(self, logits, filter_value=NEG_INF):
        V = logits.shape[-1]
        k = _per_row(self.top_k, logits).long()
        keep_all = (k <= 0) | (k >= V)
        largest = int(k.masked_fill(keep_all, 0).max())  # a partial top-k, not a sort of the vocabulary
        if largest == 0:
            return logits
        kth = logits.topk(largest, dim=-1).values.gather(1, k.clamp(1, largest) - 1)
        kth = kth.masked_fill(keep_all, NEG_INF)  # ties with the k-th value are kept, as before
        return logits.masked_fill(logits < kth, filter_value)


FIRST_RANKS = 256  # tokens top-p ranks first (see TopPStrategy)
RANKS_GROWTH = 16  # and how many times more each time those fall short


class TopPStrategy(BaseSamplingStrategy):
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1.0 keeps all),
    and every token tied with the least likely of them, as top-k keeps ties at the k-th value.

    Keeping the ties makes the kept set a function of the row's values alone: which of two equal
    logits a sort puts first depends on the sort (a partial ``topk`` or a full sort, chosen by what
    the other rows of the batch left in), so cutting between them could let a seeded request's
    tokens depend on its batch mates.

    Only the ``FIRST_RANKS`` most likely tokens are ranked first (a partial ``topk``), their
    probabilities taken against the whole row's normaliser: when they reach top_p in every row
    that cuts, the cut lies among them and the rest need no order; otherwise 16 times as many
    are ranked, and so on up to all of them. Sorting the whole vocabulary took 2.2 ms a step
    for one row of 32,000 logits on the 2-vCPU VM (the chat page asks for top_p 0.95 by
    default), against 0.2 ms with a peaked row (top_p 0.95 kept 15 tokens) and 0.4 ms with a
    broader one (3,123 kept); a flat row, whose cut lies tens of thousands of tokens down,
    ranks them all after the partial attempts, some 0.3 ms more than a sort alone."""

    def __init__(self, top_p: Param):
        self.top_p = top_p

    def apply(self, logits, filter_value=NEG_INF):
        p = _per_row(self.top_p, logits).to(torch.float32)
        keeps_all = p >= 1  # even where rounding sums past 1
        # Only tokens an earlier filter (top-k) left in can be kept, so only they are ranked: the
        # largest count of them in any row, every one of them in each row, the rest already filtered.
        candidates = max(int(torch.isfinite(logits).sum(dim=-1).max()), 1)
        ranks = min(candidates, FIRST_RANKS)
        # the rows' normaliser: from the ranked tokens when they are all the row holds (after top-k)
        log_total = None if ranks == candidates else torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        while True:
            if ranks < logits.shape[-1]:
                ranked = logits.topk(ranks, dim=-1).values
            else:
                ranked = logits.sort(dim=-1, descending=True).values
            if log_total is None:
                log_total = torch.logsumexp(ranked.float(), dim=-1, keepdim=True)
            probs = (ranked.float() - log_total).exp()
            reached = probs.cumsum(dim=-1)
            if ranks == candidates or bool(((reached[:, -1:] >= p) | keeps_all).all()):
                break
            ranks = min(candidates, ranks * RANKS_GROWTH)
        mass_before = reached - probs
        # the most likely token always stays; the kept tokens are a prefix of the ranked row
        kept = (mass_before < p).sum(dim=-1, keepdim=True).clamp_min(1)
        least_kept = ranked.gather(1, kept - 1).masked_fill(keeps_all, NEG_INF)
        return logits.masked_fill(logits < least_kept, filter_value)


class MinPStrategy(BaseSamplingStrategy):
    """Drop tokens whose probability is below min_p times the most likely token's (0 keeps all)."""

    def __init__(self, min_p: Param):
        self.min_p = min_p

    def apply(self, logits, filter_value=NEG_INF):
        m = _per_row(self.min_p, logits).to(torch.float32)
        probs = logits.float().softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * m
        return logits.masked_fill(probs < threshold, filter_value)


class SamplingPipeline:
    """Strategies applied in order, then a draw per row."""

    def __init__(self, strategies: Sequence[BaseSamplingStrategy]):
        self.strategies = list(strategies)

    @classmethod
    def from_params(cls, temperature: Param = 1.0, top_k: Param = 0, top_p: Param = 1.0, min_p: Param = 0.0) -> "SamplingPipeline":
        return cls([TemperatureStrategy(temperature), TopKStrategy(top_k), TopPStrategy(top_p), MinPStrategy(min_p)])

    @classmethod
    def for_rows(cls, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
                 min_p: Sequence[float], device: torch.device) -> "SamplingPipeline":
        """One row's settings per list entry → the strategies some row needs, with the values moved to
        ``device`` in one copy. A strategy that no row uses (temperature 1, top_k 0, top_p 1, min_p 0) is
        left out: each is an exact identity on such rows, so no draw changes, and top-k and top-p would
        otherwise sort the whole vocabulary of every row at every step."""
        table = torch.tensor([list(temperature), list(top_k), list(top_p), list(min_p)], dtype=torch.float32)
        table = table.to(device)
        used = [any(t != 1 for t in temperature), any(k > 0 for k in top_k), any(p < 1 for p in top_p),
                any(m > 0 for m in min_p)]
        kinds = (TemperatureStrategy, TopKStrategy, TopPStrategy, MinPStrategy)
        return cls([kind(table[i]) for i, kind in enumerate(kinds) if used[i]])

    def apply(self, logits: torch.Tensor, filter_value: float = NEG_INF) -> torch.Tensor:
        for strategy in self.strategies:
            logits = strategy.apply(logits, filter_value)
        return logits

    def sample(self, logits: torch.Tensor, filter_value: float = NEG_INF,
               generators: Optional[Sequence[Optional[torch.Generator]]] = None) -> torch.Tensor:
        """Token ids [B] drawn from the filtered distribution of each row."""
        probs = self.apply(logits.float(), filter_value).softmax(dim=-1)
        return draw(probs, generators)


ARGMAX_BLOCK = 128
NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for [B, V]: the same first index of each row's maximum, faster.

    torch's CPU argmax along a long last dimension runs far below memory speed (5 rows of
    49,152 logits: 133 µs), numpy's at it (19 µs), so CPU floats numpy holds go through numpy.
    Others (bf16) take two passes: the block maxima (``amax`` is vectorised), the argmax over
    them for each row's first block holding its maximum, then a short argmax inside that block
    (36 µs). Small inputs, where the extra ops cost more, take ``argmax``.
    """
    if x.is_cpu and x.dtype in NUMPY_FLOATS:
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    rows, width = x.shape
    if width % ARGMAX_BLOCK or rows * width < 4 * 8192 or not x.is_cpu:
        return x.argmax(dim=-1)
    blocks = x.reshape(rows, width // ARGMAX_BLOCK, ARGMAX_BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)
    within = blocks[torch.arange(rows, device=x.device), best].argmax(dim=-1)
    return best * ARGMAX_BLOCK + within


def draw(probs: torch.Tensor, generators: Optional[Sequence[Optional[torch.Generator]]] = None,
         shared: Optional[torch.Generator] = None) -> torch.Tensor:
    """One categorical draw per row: argmax(p / E) with E ~ Exp(1).

    A row with its own generator (a seeded request) takes its noise from it alone, so its tokens do
    not depend on its batch; the other rows share one draw from ``shared`` (one call, not one per row).
    """
    # E = -log U with U ~ Uniform[0, 1): torch's CPU exponential_ runs about 5x slower than uniform_
    # plus a vectorised log (64 x 4,096 draws: 5.2 ms against 0.95 ms). U = 0 gives E = inf, so p / E = 0.
    uniform = torch.empty_like(probs)
    own = [] if generators is None else [i for i, gen in enumerate(generators) if gen is not None]
    if len(own) < probs.shape[0]:
        uniform.uniform_(generator=shared)
    for i in own:
        uniform[i].uniform_(generator=generators[i])
    return row_argmax(probs / uniform.log_().neg_())


def sample(logits: torch.Tensor, temperature: Param = 1.0, top_k: Param = 0, top_p: Param = 1.0,
           min_p: Param = 0.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sample token ids [B] from logits [B, V]; temperature 0 means greedy (argmax)."""
    if isinstance(temperature, (int, float)) and temperature == 0:
        return row_argmax(logits)
    pipeline = SamplingPipeline.from_params(temperature, top_k, top_p, min_p)
    return pipeline.sample(logits, generators=[generator] * logits.shape[0] if generator is not None else None)


def apply_penalties(logits: torch.Tensor, context_ids: Sequence[int], output_ids: Sequence[int],
                    repetition: float = 1.0, frequency: float = 0.0, presence: float = 0.0) -> torch.Tensor:
    """Penalise one row [V] in place by what was already said.

    repetition (> 1 discourages) divides positive / multiplies negative logits of
    every token in prompt or output; frequency subtracts ``frequency * count`` and
    presence subtracts ``presence`` once for tokens of the output (OpenAI's definitions).
    """
    V = logits.shape[-1]
    if repetition != 1.0 and context_ids:
        seen = torch.tensor(list(set(context_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / repetition, values * repetition)
    if (frequency or presence) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=logits.device), minlength=V)[:V]
        logits -= frequency * counts.to(logits.dtype) + presence * (counts > 0).to(logits.dtype)
    return logits
