"""DraftHead: a small network that guesses a target model's next tokens from its last hidden state.

Speculative decoding verifies several guessed tokens in one target step; the guesses must be
cheap and often right. The head follows EAGLE: from the target's final hidden state h_p (what
its lm_head reads) and the embedding of t_{p+1}, one small layer predicts the hidden state the
target will have at p+1 and, through its own output projection, t_{p+2}; fed its own hidden
state and guess, the same layer goes on to t_{p+3}, and so on. Its output covers a reduced
vocabulary (the tokens the target emits most, after FR-Spec / EAGLE-3), mapped back to target
ids, so a draft token costs a few small matmuls instead of a full-vocabulary GEMV. The
token embedding is the target's own, frozen and never saved with the head.

On disk: ``draft_head.json`` (DraftHeadConfig) and ``draft_head.safetensors`` in one
directory; ``load_draft_head`` checks the config against the target it is meant for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from astrai.config.json_file import JsonConfig
from astrai.errors import ConfigError
from astrai.model.components.layers import Linear, RMSNorm
from astrai.model.quantized import HEAD_BITS, QuantizedLinear
from astrai.model.weight_files import atomic_save, atomic_write_text

CONFIG_FILE = "draft_head.json"
WEIGHTS_FILE = "draft_head.safetensors"
FINGERPRINT_ROWS = 16
# the fingerprint is a few statistics of the target's embedding and final norm; the same weights
# at another precision (bf16, int8 blocks) stay well inside this, another model does not
FINGERPRINT_RTOL = 0.05


@dataclass
class DraftHeadConfig(JsonConfig):
    """Shapes of a head and the target it was trained for (``dim``, ``vocab_size``, fingerprint)."""

    dim: int
    vocab_size: int
    draft_vocab_size: int
    hidden_dim: int
    norm_eps: float = 1e-6
    target_fingerprint: list = field(default_factory=list)
    model_type: str = "draft_head"

    def validate(self) -> "DraftHeadConfig":
        for name in ("dim", "vocab_size", "draft_vocab_size", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"DraftHeadConfig.{name}: must be a positive integer (got {value!r})")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"DraftHeadConfig.draft_vocab_size: {self.draft_vocab_size} exceeds the target's "
                              f"vocabulary ({self.vocab_size})")
        if self.model_type != "draft_head":
            raise ConfigError(f"DraftHeadConfig.model_type: expected 'draft_head' (got {self.model_type!r})")
        return self


def target_fingerprint(target: nn.Module) -> list[float]:
    """Norms of a fixed spread of embedding rows and of the final norm's scale: enough to tell
    one model from another of the same shape without reading every weight."""
    table = target.embed_tokens.weight.detach().float()
    rows = torch.linspace(0, table.shape[0] - 1, FINGERPRINT_ROWS).long()
    values = table[rows].norm(dim=-1).tolist()
    values.append(float(target.norm.weight.detach().float().norm()))
    return [round(v, 6) for v in values]


def fingerprints_match(saved: list[float], current: list[float]) -> bool:
    if len(saved) != len(current):
        return False
    a, b = torch.tensor(saved), torch.tensor(current)
    return bool(torch.allclose(a, b, rtol=FINGERPRINT_RTOL, atol=1e-4))


class DraftHead(nn.Module):
    """The head's weights, bound by reference to its target for the token embedding.

    The target is held outside the module tree (``bind``): its weights are neither trained,
    moved, nor saved with the head's.
    """

    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self.config = config.validate()
        dim, hidden = config.dim, config.hidden_dim
        self.hidden_norm = RMSNorm(dim, config.norm_eps)
        self.embed_norm = RMSNorm(dim, config.norm_eps)
        self.fuse = Linear(2 * dim, dim)
        self.mlp_norm = RMSNorm(dim, config.norm_eps)
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)
        self.out_norm = RMSNorm(dim, config.norm_eps)
        self.out_proj = Linear(dim, config.draft_vocab_size)
        # row i of out_proj scores target token draft_ids[i]; saved with the weights
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size), persistent=True)
        self._target: tuple[nn.Module, ...] = ()

    @classmethod
    def from_config(cls, config: DraftHeadConfig) -> "DraftHead":
        return cls(config)

    @classmethod
    def for_target(cls, target: nn.Module, draft_ids: torch.Tensor, hidden_dim: Optional[int] = None) -> "DraftHead":
        """A fresh head for ``target`` over the vocabulary ``draft_ids``; its output rows start as the
        target's lm_head rows for those tokens, so a head that predicts the target's next hidden
        state well scores tokens as the target would."""
        target_config = target.config
        config = DraftHeadConfig(dim=target_config.dim, vocab_size=target_config.vocab_size,
                                 draft_vocab_size=int(draft_ids.numel()),
                                 hidden_dim=hidden_dim or 2 * target_config.dim, norm_eps=target_config.norm_eps,
                                 target_fingerprint=target_fingerprint(target))
        head = cls(config).to(target.embed_tokens.weight.device)  # beside the target it drafts for
        with torch.no_grad():
            head.draft_ids.copy_(draft_ids)
            lm_head = getattr(target.lm_head, "weight", None)
            if isinstance(lm_head, torch.Tensor) and lm_head.is_floating_point():
                head.out_proj.weight.copy_(lm_head.detach()[draft_ids].float())
        return head.bind(target)

    def bind(self, target: nn.Module) -> "DraftHead":
        self._target = (target,)
        return self

    @property
    def target(self) -> nn.Module:
        if not self._target:
            raise ConfigError("this draft head is bound to no target; load it with load_draft_head(directory, target)")
        return self._target[0]

    def quantize(self) -> "DraftHead":
        """The head's linears in int8 blocks, in place: how the engine serves a head beside a
        quantized target. A draft token then reads a quarter of the fp32 head's bytes, which
        between two target steps come from memory, not the caches; drafts are checked by the
        target, so the rounding changes only how often they are right."""
        for name in ("fuse", "gate_proj", "up_proj", "down_proj", "out_proj"):
            linear = getattr(self, name)
            if not isinstance(linear, QuantizedLinear):
                setattr(self, name, QuantizedLinear.from_linear(linear, HEAD_BITS))
        return self

    # --- the network ---------------------------------------------------------------
    def step(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """The target's hidden state one position on, predicted from the current one and the next token."""
        x = self.fuse(torch.cat([self.hidden_norm(hidden), self.embed_norm(token_embedding)], dim=-1))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary (index i is target token ``draft_ids[i]``)."""
        return self.out_proj(self.out_norm(hidden))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding of ``token_ids``, on this head's device and in its dtype."""
        table = self.target.embed_tokens
        return table(token_ids.to(table.weight.device)).to(self.out_norm.weight)

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over any batch shape: (next hidden state, draft-vocabulary logits)."""
        new_hidden = self.step(hidden.to(self.out_norm.weight.dtype), self.embed(token_ids))
        return new_hidden, self.logits(new_hidden)

    # --- drafting ------------------------------------------------------------------
    @torch.no_grad()
    def draft_batch(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int) -> list[list[int]]:
        """k greedy guesses per row: ``hidden`` [B, dim] at the last computed position p, ``tokens``
        [B] the t_{p+1} the target chose; returns t_{p+2..p+k+1} as target ids."""
        if k < 1:
            raise ConfigError(f"draft: k must be at least 1 (got {k})")
        tokens = torch.as_tensor(tokens, device=self.draft_ids.device).reshape(-1)
        h = hidden.reshape(tokens.numel(), -1)
        guesses = []
        for _ in range(k):
            h, scores = self(h, tokens)
            tokens = self.draft_ids[scores.argmax(dim=-1)]
            guesses.append(tokens)
        return torch.stack(guesses, dim=1).tolist()

    def draft(self, hidden: torch.Tensor, token: int, k: int) -> list[int]:
        """k greedy guesses after one sequence's hidden state ``hidden`` [dim] and its next token."""
        return self.draft_batch(hidden.reshape(1, -1), torch.tensor([int(token)]), k)[0]

    # --- files ---------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        atomic_save(state, out / WEIGHTS_FILE, {"format": "pt", "model_type": "draft_head"})
        atomic_write_text(out / CONFIG_FILE, json.dumps(self.config.to_dict(), indent=2) + "\n")
        return out


def is_draft_head(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file()


def check_target(config: DraftHeadConfig, target: nn.Module, source: str) -> None:
    """ConfigError naming what differs between the target a head was trained for and ``target``."""
    target_config = target.config
    for name in ("dim", "vocab_size"):
        if getattr(config, name) != getattr(target_config, name):
            raise ConfigError(f"{source}: the draft head was trained for a target with {name} {getattr(config, name)}, "
                              f"but this target has {name} {getattr(target_config, name)}; train a head for this model "
                              "with `astrai train --train_type draft_head --param_path MODEL`")
    if not fingerprints_match(config.target_fingerprint, target_fingerprint(target)):
        raise ConfigError(f"{source}: the draft head was trained for another model of the same shape (its embedding "
                          "and final-norm fingerprint differ from this target's); train a head for this model")


def load_draft_head(directory: str | Path, target_model: nn.Module) -> DraftHead:
    """The head saved in ``directory``, bound to ``target_model`` after checking it was trained for it."""
    root = Path(directory)
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ConfigError(f"{root}: not a draft head directory (expected {CONFIG_FILE} and {WEIGHTS_FILE}; "
                          "`astrai train --train_type draft_head` writes one under <ckpt_dir>/final)")
    config = DraftHeadConfig.load(config_path).validate()
    check_target(config, target_model, str(root))
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{weights_path}: cannot read safetensors file ({exc})") from None
    head = DraftHead(config)
    missing = sorted(set(head.state_dict()) ^ set(state))
    if missing:
        raise ConfigError(f"{weights_path}: tensors do not match a draft head of this config "
                          f"({', '.join(missing[:4])})")
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:
        raise ConfigError(f"{weights_path}: tensor shapes do not match {CONFIG_FILE} ({exc})") from None
    device = target_model.embed_tokens.weight.device
    return head.to(device).eval().bind(target_model)
