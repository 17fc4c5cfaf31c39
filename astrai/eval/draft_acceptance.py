"""How many of a draft head's guesses greedy speculative decoding would accept.

The measure replays decoding on the target's own greedy continuations of held-out prompts:
at each verify step the head drafts k tokens from the target's hidden state and the token
the target just chose; the target keeps the longest prefix that matches its own choices and
adds one token of its own, and the next step starts after those. What it reports is what
speculative decoding gains: accepted tokens per verify step, tokens per target step, and for
each draft position the share of steps whose draft was accepted that far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from astrai.errors import ConfigError


@dataclass
class Acceptance:
    """Counts over all verify steps; ``per_position[i]`` = share accepted through draft token i+1."""

    k: int
    verify_steps: int = 0
    accepted: int = 0
    reached: list = field(default_factory=list)

    @property
    def mean_accepted(self) -> float:
        return self.accepted / max(self.verify_steps, 1)

    @property
    def tokens_per_step(self) -> float:
        """Tokens each target step yields: the accepted draft plus the target's own token."""
        return self.mean_accepted + 1.0

    @property
    def per_position(self) -> list[float]:
        return [count / max(self.verify_steps, 1) for count in self.reached]

    def to_dict(self) -> dict:
        return {"k": self.k, "verify_steps": self.verify_steps, "mean_accepted": round(self.mean_accepted, 4),
                "tokens_per_step": round(self.tokens_per_step, 4),
                "per_position": [round(share, 4) for share in self.per_position]}


@torch.no_grad()
def greedy_continuation(target: nn.Module, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """The target's greedy next ``new_tokens`` tokens, recomputing the whole sequence each step
    (cheap for the short sequences of a test; a benchmark takes them from the engine)."""
    device = target.embed_tokens.weight.device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(new_tokens):
        token = int(target(ids)["logits"][0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return out


@torch.no_grad()
def draft_acceptance(head, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                     k: int) -> Acceptance:
    """Replay greedy speculative decoding of each continuation (the target's own greedy output
    after its prompt) with ``head`` drafting ``k`` tokens per verify step."""
    if k < 1:
        raise ConfigError(f"draft_acceptance: k must be at least 1 (got {k})")
    if len(prompts) != len(continuations):
        raise ConfigError(f"draft_acceptance: {len(prompts)} prompts but {len(continuations)} continuations")
    target = head.target
    device = target.embed_tokens.weight.device
    result = Acceptance(k=k, reached=[0] * k)
    for prompt, continuation in zip(prompts, continuations):
        if not prompt or len(continuation) < 2:
            continue
        ids = torch.tensor([list(prompt) + list(continuation)], dtype=torch.long, device=device)
        hidden = target(ids, compute_logits=False)["hidden_states"][0]
        # position p holds the last computed token; continuation[i] is the target's choice after p
        p, i = len(prompt) - 1, 0
        while i + 1 < len(continuation):
            guesses = head.draft(hidden[p], continuation[i], k)
            expected = list(continuation[i + 1:i + 1 + k])
            accepted = 0
            while accepted < len(expected) and guesses[accepted] == expected[accepted]:
                accepted += 1
            result.verify_steps += 1
            result.accepted += accepted
            for position in range(accepted):
                result.reached[position] += 1
            p, i = p + accepted + 1, i + accepted + 1
    return result
