"""Optimisers: AdamW with decay only where it belongs, optionally Muon for hidden matrices."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _embedding_params(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def split_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """'decay' (2-D hidden weights), 'no_decay' (norms, biases, embeddings and the tied/untied head).

    Norm gains and biases are 1-D; pulling them toward 0 only fights the model.
    Embedding rows are looked up sparsely, so uniform decay would shrink rare tokens; a run
    may still decay the table on purpose (``embedding_weight_decay``, which gives it a group
    of its own beside the matrices).
    """
    embeddings = _embedding_params(model)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": []}
    seen: set[int] = set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        hidden_matrix = param.ndim == 2 and id(param) not in embeddings and param is not head
        groups["decay" if hidden_matrix else "no_decay"].append(param)
    return groups


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimisers stepped together, seen by schedulers as one (their param groups concatenated)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.defaults = {}
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]
        self.state = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state_dict: dict) -> None:
        for i, opt in enumerate(self.optimizers):
            opt.load_state_dict(state_dict[str(i)])


def _fused_supported(model: nn.Module) -> bool:
    """The single-kernel AdamW exists for CPU and CUDA float params; it avoids a pass per tensor."""
    return all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
               for p in model.parameters())


def build_optimizer(model: nn.Module, config) -> torch.optim.Optimizer:
    """AdamW (fused kernel) or Muon on hidden matrices + AdamW on the rest, per ``config.optimizer``.

    The token embedding (and the head tied to it) steps at ``max_lr · embedding_lr_scale``:
    each row only receives gradient when its token occurs, so at one shared learning rate
    the table trails the dense matrices; with a scale other than 1 it gets a group of its own.
    """
    groups = split_parameters(model)
    betas = (config.adamw_beta1, config.adamw_beta2)
    adamw_kwargs = dict(lr=config.max_lr, betas=betas, eps=config.adamw_eps, fused=_fused_supported(model))
    rest = _groups_beside_matrices(model, groups["no_decay"], config)
    if config.optimizer == "muon":
        muon = torch.optim.Muon(groups["decay"], lr=config.muon_lr, weight_decay=config.adamw_weight_decay)
        adamw = torch.optim.AdamW(rest, **adamw_kwargs)
        return CombinedOptimizer([muon, adamw])
    return torch.optim.AdamW([{"params": groups["decay"], "weight_decay": config.adamw_weight_decay}, *rest],
                             **adamw_kwargs)


def _groups_beside_matrices(model: nn.Module, params: list[nn.Parameter], config) -> list[dict[str, Any]]:
    """The AdamW groups outside the hidden matrices: norms, biases and the token embedding,
    undecayed in one group; or two, when the embedding has a rate or a decay of its own.

    Decaying the table suits long runs over repeated text: a row stepped at a large rate
    memorises the few contexts its rare token appears in."""
    if config.embedding_lr_scale == 1.0 and config.embedding_weight_decay == 0.0:
        return [{"params": params, "weight_decay": 0.0}]
    embeddings = _embedding_params(model)
    table = [p for p in params if id(p) in embeddings]
    other = [p for p in params if id(p) not in embeddings]
    groups = [{"params": other, "weight_decay": 0.0}]
    if table:
        groups.append({"params": table, "weight_decay": config.embedding_weight_decay,
                       "lr": config.max_lr * config.embedding_lr_scale})
    return groups
