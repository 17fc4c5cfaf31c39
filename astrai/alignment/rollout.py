"""GRPO rollouts: sample a group of responses per prompt with the inference engine.

The engine is built once around its own copy of the policy and refreshed with
``update_weights`` on schedule, so rollouts run at the engine's full speed (paged
KV cache, continuous batching) without a rebuild per step. A rollout comes back as
one right-padded tensor of prompt+response ids with a mask over the response
tokens, which is exactly what the GRPO loss consumes.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from astrai.errors import ConfigError
from astrai.inference import InferenceEngine, SamplingParams


@dataclass
class RolloutBatch:
    """``group_size`` responses per prompt, grouped consecutively (prompt 0's group first).

    Response ids include the stop token that ended them (so the policy learns to stop);
    response texts are the engine's decoded text without it.
    """

    input_ids: torch.Tensor          # [N, L] prompt + response, right-padded with 0
    response_mask: torch.Tensor      # [N, L] 1 on response tokens
    prompt_texts: list[str]
    response_texts: list[str]
    seconds: float = 0.0

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+response ids and a mask that is 1 exactly on response tokens."""
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        mask[i, len(p):len(p) + len(r)] = 1
    return ids, mask


class EngineRollout:
    """Samples with an InferenceEngine that holds a private copy of the policy's weights."""

    def __init__(self, engine, tokenizer, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0, timeout_s: float = 600.0):
        if max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be positive, got {max_new_tokens}")
        self.engine, self.tokenizer = engine, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.seed, self.timeout_s = seed, timeout_s
        self.requests = 0

    @classmethod
    def for_policy(cls, policy: nn.Module, tokenizer, max_batch_size: int = 64, max_new_tokens: int = 64,
                   temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, dtype: Optional[torch.dtype] = None,
                   **engine_kwargs) -> "EngineRollout":
        """Build the engine once, around a detached eval-mode copy of the policy (in ``dtype`` when given:
        the engine runs on its own thread, outside the trainer's thread-local autocast)."""
        behaviour = copy.deepcopy(getattr(policy, "module", policy)).eval()
        if dtype is not None:
            behaviour.to(dtype)
        for p in behaviour.parameters():
            p.requires_grad_(False)
        engine_kwargs.setdefault("max_queue", 8192)  # a whole step's requests are queued at once
        engine_kwargs.setdefault("in_place", True)  # behaviour is already a copy of its own
        engine = InferenceEngine(behaviour, tokenizer, max_batch_size=max_batch_size, **engine_kwargs)
        return cls(engine, tokenizer, max_new_tokens, temperature, top_p, seed)

    def update_weights(self, policy: nn.Module) -> None:
        """Load the policy's current weights into the engine (drops its prefix cache; cast to the engine's dtype)."""
        state = getattr(policy, "module", policy).state_dict()
        self.engine.update_weights({k: v.detach() for k, v in state.items()})

    def close(self) -> None:
        self.engine.shutdown()

    def generate(self, prompts: Sequence[Sequence[int]], group_size: int,
                 prompt_texts: Optional[Sequence[str]] = None) -> RolloutBatch:
        """Submit every (prompt, sample) pair at once and let the engine batch them."""
        start = time.perf_counter()
        handles = []
        for prompt in prompts:
            for _ in range(group_size):
                params = SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                        seed=self.seed * 1_000_003 + self.requests)
                self.requests += 1
                handles.append(self.engine.submit(list(prompt), params))
        try:
            results = [h.result(timeout=self.timeout_s) for h in handles]
        except TimeoutError:
            for h in handles:
                h.abort()
            raise RuntimeError(f"GRPO rollout: the inference engine did not finish {len(handles)} requests within "
                               f"{self.timeout_s:.0f} s") from None
        for r in results:
            if r.error:
                raise RuntimeError(f"GRPO rollout failed in the inference engine: {r.error}")
        responses = [list(r.token_ids) for r in results]
        repeated = [list(p) for p in prompts for _ in range(group_size)]
        ids, mask = pack_sequences(repeated, responses)
        texts = list(prompt_texts) if prompt_texts is not None else [self.tokenizer.decode(list(p)) for p in prompts]
        return RolloutBatch(
            input_ids=ids, response_mask=mask,
            prompt_texts=[t for t in texts for _ in range(group_size)],
            response_texts=[r.text for r in results],
            seconds=time.perf_counter() - start,
        )
