"""Feed-forward layers: SwiGLU MLP and DeepSeekMoE (shared + routed experts)."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from astrai.config import ModelConfig
from astrai.factory import BaseFactory
from astrai.model.components.layers import Linear


class FFNFactory(BaseFactory[nn.Module]):
    """ffn_type → feed-forward class ('mlp', 'moe')."""

    kind = "ffn type"


@FFNFactory.register("mlp")
class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, dim_ffn: int):
        super().__init__()
        self.gate = Linear(dim, dim_ffn)
        self.up = Linear(dim, dim_ffn)
        self.down = Linear(dim_ffn, dim)

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The linears that read the input, in the order ``project`` returns them."""
        return (self.gate, self.up)

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x) for m in self.input_projections()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)
        return self.down(F.silu(gate) * up)


@FFNFactory.register("moe")
class DeepSeekMoE(nn.Module):
    """Mixture of experts: always-on shared experts plus top-k routed experts.

    Routing: ``greedy`` takes the top-k of a softmax over experts; ``sigmoid`` scores
    each expert independently (DeepSeek-V3 style). Selected weights are renormalised
    to sum to 1 when ``norm_topk_prob`` (always for sigmoid). During training the
    Switch-style load-balancing loss ``n_experts * sum_i f_i * P_i`` is kept in
    ``aux_loss`` for the Transformer to collect; ``expert_load`` holds the fraction of
    routed slots each expert received in the last forward, for logging.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_routed_experts = config.n_routed_experts
        self.n_shared_experts = config.n_shared_experts
        self.n_activated_experts = config.n_activated_experts
        self.topk_method = config.moe_topk_method
        self.norm_topk_prob = config.norm_topk_prob or config.moe_topk_method == "sigmoid"
        self.aux_loss_coef = config.aux_loss_coef
        hidden = config.moe_dim_ffn or config.dim_ffn
        self.router = Linear(config.dim, self.n_routed_experts)
        self.routed_experts = nn.ModuleList(MLP(config.dim, hidden) for _ in range(self.n_routed_experts))
        self.shared_experts = nn.ModuleList(MLP(config.dim, hidden) for _ in range(self.n_shared_experts))
        self.aux_loss: torch.Tensor | None = None
        self.register_buffer("expert_load", torch.zeros(self.n_routed_experts), persistent=False)

    def route(self, x_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (weights [N,k], expert indices [N,k], full score matrix [N,E])."""
        logits = self.router(x_flat).float()
        scores = logits.softmax(dim=-1) if self.topk_method == "greedy" else logits.sigmoid()
        weights, indices = scores.topk(self.n_activated_experts, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return weights, indices, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_flat = x.reshape(-1, shape[-1])
        weights, indices, scores = self.route(x_flat)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts)
        with torch.no_grad():
            self.expert_load = counts.float() / counts.sum().clamp_min(1)
        if self.training and self.aux_loss_coef > 0:
            probs = scores / scores.sum(dim=-1, keepdim=True)
            load = counts.float() * self.n_routed_experts / (x_flat.shape[0] * self.n_activated_experts)
            self.aux_loss = self.aux_loss_coef * (load.detach() * probs.mean(dim=0)).sum()
        else:
            self.aux_loss = None
        out = torch.zeros_like(x_flat)
        flat_idx = indices.flatten()
        order = flat_idx.argsort()
        token_of_slot = order // self.n_activated_experts
        slot_weights = weights.flatten()[order].to(x.dtype)
        offsets = counts.cumsum(0).tolist()
        # In training every expert runs, an idle one on zero rows: its gradient is then zero
        # rather than missing, which DDP and FSDP need (each rank must reduce the same
        # parameters; which experts a rank's tokens reach differs) and which keeps one process
        # and several identical.
        run_idle = self.training and torch.is_grad_enabled()
        start = 0
        for expert_id, end in enumerate(offsets):
            if end > start or run_idle:
                tokens = token_of_slot[start:end]
                y = self.routed_experts[expert_id](x_flat[tokens]) * slot_weights[start:end, None]
                out.index_add_(0, tokens, y)
            start = end
        for expert in self.shared_experts:
            out = out + expert(x_flat)
        return out.view(shape)


def build_ffn(config: ModelConfig, layer_idx: int) -> nn.Module:
    if config.is_moe_layer(layer_idx):
        return FFNFactory.create("moe", config)
    return FFNFactory.create("mlp", config.dim, config.dim_ffn)
