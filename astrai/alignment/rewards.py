"""Rewards for GRPO: a Python callable, the rule-based arithmetic checker, or a trained reward model.

``resolve_reward(spec)`` turns what a user types after ``--reward`` into a Reward:

- ``arithmetic``: the bundled task's rule: 1.0 when the response is exactly the value
  of the ``a+b`` / ``a-b`` / ``a*b`` problem in the prompt, else 0.0;
- ``package.module:function``: any ``function(prompt: str, response: str) -> float``;
- a model directory saved by ``astrai train --train_type rm``: the reward model's score.

``compute_rewards`` checks every value, so a callable that raises or returns NaN
stops training with a message naming the reward and the sample instead of
silently poisoning the advantages.
"""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from astrai.dataset.arithmetic import check_answer
from astrai.errors import ConfigError, DataError
from astrai.model import AutoModel
from astrai.model.reward import RewardModel, last_token_index

PROBLEM_RE = re.compile(r"(-?\d+)\s*([+\-*×x])\s*(-?\d+)")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "×": lambda a, b: a * b,
       "x": lambda a, b: a * b}


def arithmetic_reward(prompt: str, response: str) -> float:
    """The bundled task's checker (``astrai.dataset.arithmetic.check_answer``) on the prompt's problem.

    The problem is read back from the prompt text (the last ``a op b`` in it), so the
    reward works on raw ("3+4=") and chat-formatted prompts alike.
    """
    problems = PROBLEM_RE.findall(prompt)
    if not problems:
        raise DataError(f"arithmetic reward: no 'a+b' style problem found in prompt {prompt[-80:]!r}")
    a, op, b = problems[-1]
    return check_answer({"answer": str(OPS[op](int(a), int(b)))}, response)


class Reward:
    """Scores a batch of (prompt, response) texts, with their token ids for model-based rewards."""

    name = "reward"

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], input_ids: torch.Tensor,
                 response_mask: torch.Tensor) -> list[float]:
        raise NotImplementedError


class FunctionReward(Reward):
    """A per-sample Python callable ``fn(prompt, response) -> float``."""

    def __init__(self, fn: Callable[[str, str], float], name: Optional[str] = None):
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", repr(fn))

    def __call__(self, prompts, responses, input_ids, response_mask) -> list[float]:
        values = []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            try:
                values.append(self.fn(prompt, response))
            except Exception as exc:
                raise DataError(f"reward '{self.name}' raised {type(exc).__name__}: {exc} on sample {i} "
                                f"(prompt {prompt[-60:]!r}, response {response[:60]!r})") from exc
        return values


class RewardModelReward(Reward):
    """A trained RewardModel reading each sequence's last response token."""

    def __init__(self, model, name: str = "reward model"):
        self.model = model.eval()
        self.name = name

    def __call__(self, prompts, responses, input_ids, response_mask) -> list[float]:
        device = next(self.model.parameters()).device
        ids, mask = input_ids.to(device), response_mask.to(device)
        with torch.no_grad():
            return self.model(ids, logits_index=last_token_index(mask, ids))["rewards"].tolist()


def _import_callable(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--reward {spec!r}: cannot import {attr!r} from module {module_name!r} ({exc})") from None
    if not callable(fn):
        raise ConfigError(f"--reward {spec!r}: {attr!r} is not callable")
    return fn


def resolve_reward(spec, device: str | torch.device = "cpu") -> Reward:
    """A Reward from a Reward, a callable, 'arithmetic', 'module:function' or a reward-model directory."""
    if isinstance(spec, Reward):
        return spec
    if callable(spec):
        return FunctionReward(spec)
    if not isinstance(spec, str) or not spec:
        raise ConfigError("GRPO needs --reward: 'arithmetic', 'package.module:function' or a reward-model directory")
    if spec == "arithmetic":
        return FunctionReward(arithmetic_reward, "arithmetic")
    if Path(spec).is_dir():
        model = AutoModel.from_pretrained(spec, device=device)
        if not isinstance(model, RewardModel):
            raise ConfigError(f"--reward {spec}: model_type is {model.config.model_type!r}, not a reward model")
        return RewardModelReward(model, name=spec)
    if ":" in spec:
        return FunctionReward(_import_callable(spec), spec)
    raise ConfigError(f"--reward {spec!r}: expected 'arithmetic', 'package.module:function' or an existing "
                      "reward-model directory")


def compute_rewards(reward: Reward, prompts: Sequence[str], responses: Sequence[str], input_ids: torch.Tensor,
                    response_mask: torch.Tensor) -> torch.Tensor:
    """Call the reward and insist on one finite number per response."""
    values = reward(prompts, responses, input_ids, response_mask)
    if len(values) != len(responses):
        raise DataError(f"reward '{reward.name}' returned {len(values)} values for {len(responses)} responses")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"reward '{reward.name}' returned {value!r} for sample {i} (response "
                            f"{responses[i][:60]!r}); rewards must be finite numbers")
    return torch.tensor([float(v) for v in values], dtype=torch.float32)
