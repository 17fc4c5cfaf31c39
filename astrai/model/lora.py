"""LoRA: low-rank adapters on chosen linear projections, trained while the base stays frozen.

An adapted projection computes W x + (α / r) · B A x with A [r, in] random and B
[out, r] zero, so a freshly injected model is exactly the base model. The adapted
layer keeps the base weight under its original name (``...q_proj.weight``) and adds
``...q_proj.lora_A`` / ``...q_proj.lora_B``, so base checkpoints still load and the
adapters can be saved on their own (``adapter_model.safetensors`` +
``adapter_config.json``) or merged into W for serving. ``adapters_disabled`` turns
them off temporarily, which gives DPO/GRPO their reference model for free.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from astrai.errors import CheckpointError, ConfigError
from astrai.model.components.layers import Linear

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class LoraConfig:
    """Rank r, scale α (the update is multiplied by α / r) and the projection names to adapt.

    ``targets`` are matched against the last component of module names, e.g.
    ``q_proj`` adapts every layer's query projection; ``gate``/``up``/``down`` adapt the MLP.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    dropout: float = 0.0

    def validate(self) -> "LoraConfig":
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"lora_rank must be a positive integer, got {self.rank!r}")
        if self.alpha <= 0:
            raise ConfigError(f"lora_alpha must be > 0, got {self.alpha!r}")
        if not self.targets:
            raise ConfigError("lora_targets must name at least one projection, e.g. q_proj,v_proj")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.dropout!r}")
        return self


class LoRALinear(nn.Linear):
    """A linear layer that shares its base weight and adds a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.adapter_enabled:
            out = out + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling
        return out

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A) * self.scaling

    def to_linear(self) -> nn.Linear:
        """astrai's plain ``Linear`` whose weight is W + (α/r)·B A (the base weight is updated in place)."""
        with torch.no_grad():
            self.weight.add_(self.delta_weight().to(self.weight.dtype))
        with torch.device("meta"):
            merged = Linear(self.in_features, self.out_features, bias=self.bias is not None)
        merged.weight = self.weight
        merged.bias = self.bias
        return merged


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def inject_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Wrap every targeted ``nn.Linear`` in a LoRALinear and freeze everything else.

    Returns the adapted module names. Raises ConfigError when a target matches nothing,
    so a typo in ``--lora_targets`` cannot silently train zero parameters.
    """
    config.validate()
    names = [name for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear) and name.rsplit(".", 1)[-1] in config.targets]
    matched = {name.rsplit(".", 1)[-1] for name in names}
    missing = [t for t in config.targets if t not in matched]
    if missing:
        linear_names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"lora_targets {', '.join(missing)} match no linear layer; available: {', '.join(linear_names)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        _set_submodule(model, name, LoRALinear(model.get_submodule(name), config.rank, config.alpha, config.dropout))
    model.lora_config = config
    return names


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, keyed by their names in the model."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` (the base is not saved)."""
    if not has_lora(model):
        raise ConfigError("save_adapter: the model has no LoRA adapters; call inject_lora first")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config: LoraConfig = model.lora_config
    base_type = getattr(getattr(model, "config", None), "model_type", None)
    save_file(lora_state_dict(model), str(out / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    meta = {"peft_type": "LORA", "base_model_type": base_type, **asdict(config)}
    (out / ADAPTER_CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


def load_lora_config(directory: str | Path) -> LoraConfig:
    path = Path(directory) / ADAPTER_CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; an adapter directory needs {ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return LoraConfig(rank=raw["rank"], alpha=raw["alpha"], targets=list(raw["targets"]),
                          dropout=raw.get("dropout", 0.0)).validate()
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: malformed adapter config ({exc})") from None


def load_adapter(model: nn.Module, directory: str | Path) -> nn.Module:
    """Inject adapters as described by ``adapter_config.json`` (unless present) and load their weights."""
    directory = Path(directory)
    config = load_lora_config(directory)
    if not has_lora(model):
        inject_lora(model, config)
    weights = directory / ADAPTER_WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing adapter weights")
    with safe_open(str(weights), framework="pt") as reader:
        state = {k: reader.get_tensor(k) for k in reader.keys()}
    expected = lora_state_dict(model)
    if set(state) != set(expected):
        extra = sorted(set(state) ^ set(expected))[:3]
        raise CheckpointError(f"{weights}: adapter names do not match this model ({', '.join(extra)} …)")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(f"{weights}: '{name}' has shape {tuple(tensor.shape)}, model expects {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=False)
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and drop the adapters (for serving/export)."""
    for name, module in lora_modules(model).items():
        _set_submodule(model, name, module.to_linear())
    for p in model.parameters():
        p.requires_grad_(True)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model: inside this block every adapter contributes nothing."""
    modules = list(lora_modules(model).values())
    previous = [m.adapter_enabled for m in modules]
    for m in modules:
        m.adapter_enabled = False
    try:
        yield model
    finally:
        for m, state in zip(modules, previous):
            m.adapter_enabled = state
