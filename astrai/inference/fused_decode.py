"""A single request's decode step in one call into C, for the models it fits.

With one row, a decode step of a small model is mostly not arithmetic: each layer's norms,
rotary embedding, K/V writes, SiLU and residuals are some 60 PyTorch operator calls on a
few hundred floats, each a few microseconds with the Python around it. On the AMD VM that
was 4-5 ms of a ~125M model's 20 ms step, the rest being the one-row products streaming
the weights. ``native/decode_step.c`` does the whole step - embedding row, every layer,
final norm, head - in one call, between the same one-row products and decode attention
the unfused step uses, so the step costs what streaming the weights costs.

It fits a plain model only: GQA attention without QK-norm, output gate or biases, dense
SwiGLU feed-forwards, fp32 on the CPU, row-major weights with q/k/v and gate/up each stacked
in one buffer (as the engine lays them, weight_layout.py), no LoRA layers and no hooks, and the
C kernels built. ``FusedDecode.for_model`` says None for anything else, and a step whose
context is not in the decode buffers yet (the first after a prefill) or that has several
rows takes the usual forward; ``ASTRAI_FUSED_DECODE=0`` turns it off. Before each step the weights' addresses are compared with
those the table was built from, so a model changed in place (weights reloaded, cast,
re-laid, LoRA layers swapped in) is checked again instead of read through stale pointers.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from astrai.model.components.attention import GQA
from astrai.model.components.ffn import MLP
from astrai.model.components.joint_weights import joint_weight
from astrai.model.components.layers import Embedding, Linear, RMSNorm, rotary_tables
from astrai.model.components.native_kernels import decode_step, kernels_available, row_major

COLUMNS = 14  # int64 values per layer in the C kernel's table (native/decode_step.c)


class FusedDecode:
    """Runs one-row decode steps of ``model`` through ``native/decode_step.c``."""

    def __init__(self, model: nn.Module):
        self.model = model
        config = model.config
        self.dims = (config.dim, config.n_heads, config.n_kv_heads, config.resolved_head_dim, config.dim_ffn)
        self.eps = float(config.norm_eps)
        self.scale = config.resolved_head_dim ** -0.5
        self._watched = _watched(model)
        self._modules = _modules_of(model, self._watched)
        self._parameters: list[torch.Tensor] = []
        self._addresses: Optional[tuple] = None  # the weights' addresses when the table was last built
        self._static: Optional[torch.Tensor] = None
        self._rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def for_model(cls, model: nn.Module) -> Optional["FusedDecode"]:
        """A fused decoder for ``model``, or None when the model is not of the shape it handles
        (or ``$ASTRAI_FUSED_DECODE`` is 0, which keeps every step on the model's own forward)."""
        if os.environ.get("ASTRAI_FUSED_DECODE", "1") == "0" or not kernels_available() or not _plain_structure(model):
            return None
        fused = cls(model)
        return fused if fused._weights_ready() else None

    def __call__(self, token: int, view) -> Optional[torch.Tensor]:
        """Logits [1, vocab] of one decode step of one row whose new token is ``token``, with the
        K/V written where ``view`` (a one-row ``KvcacheView`` over the decode buffers) says;
        None when the step or the model does not qualify (the caller runs the usual forward)."""
        target = view.single_row_target()
        if target is None or not self._weights_ready():
            return None
        if not (0 <= token < self.model.embed_tokens.weight.shape[0] and 0 <= target.pos < target.capacity):
            return None  # the model's own forward reports it; C would read or write out of bounds
        table = self._static.clone()
        table[:, 10:] = torch.tensor([target.k_pages, target.v_pages, target.k_buffers, target.v_buffers]).t()
        cos, sin = self._rotary_row(target.pos)
        model = self.model
        logits = decode_step(model.embed_tokens.weight, token, table, self.dims, cos, sin, target.pos,
                             target.capacity, self.eps, self.scale, model.norm.weight, model.lm_head.weight)
        return logits.view(1, -1)

    def _weights_ready(self) -> bool:
        """Whether the table of weight pointers is current: rebuilt (and checked) when a module
        or parameter was replaced, or a weight moved, cast or re-laid, since it was made. A
        model found not to fit is checked again only after such a change, not every step."""
        if any(table.get(name) is not item for table, name, item in self._watched):
            self._watched = _watched(self.model)
            self._modules = _modules_of(self.model, self._watched)
            self._addresses = None
        if _hooked(self._modules):
            return False
        if tuple(p.data_ptr() for p in self._parameters) == self._addresses:
            return self._static is not None
        self._parameters = list(self.model.parameters())
        self._static = _weight_table(self.model) if _plain_structure(self.model) else None
        self._addresses = tuple(p.data_ptr() for p in self._parameters)
        self._rotary = None
        return self._static is not None

    def _rotary_row(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary_tables``' (cos, sin) rows for position ``pos``, from a table made by the
        model's own rotary module for a range of positions (doubled when outgrown)."""
        if self._rotary is None or pos >= self._rotary[0].shape[0]:
            length = max(2 * pos + 2, 256)
            positions = torch.arange(length).unsqueeze(0)
            cos, sin = self.model.rotary_embedding(torch.empty(1, length, 0), positions)
            cos, sin = rotary_tables(cos, sin, torch.float32)
            self._rotary = (cos.reshape(length, -1).contiguous(), sin.reshape(length, -1).contiguous())
        return self._rotary[0][pos], self._rotary[1][pos]


def _plain_structure(model: nn.Module) -> bool:
    """A Transformer of GQA + SwiGLU blocks with no options the C step leaves out, and no hooks."""
    config = getattr(model, "config", None)
    layers = getattr(model, "layers", None)
    if config is None or layers is None or not all(hasattr(model, n) for n in ("embed_tokens", "norm", "lm_head")):
        return False
    if (config.attn_type != "gqa" or config.use_qk_norm or config.use_gated_attention or config.attn_bias
            or config.n_heads % config.n_kv_heads or config.resolved_head_dim % 2):
        return False
    if type(model.embed_tokens) is not Embedding or type(model.norm) is not RMSNorm or type(model.lm_head) is not Linear:
        return False
    for layer in layers:
        attention, mlp = getattr(layer, "attention", None), getattr(layer, "mlp", None)
        if type(attention) is not GQA or type(mlp) is not MLP:
            return False
        if type(layer.input_norm) is not RMSNorm or type(layer.post_attention_norm) is not RMSNorm:
            return False
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate, mlp.up, mlp.down)
        if any(type(m) is not Linear or m.bias is not None for m in linears):
            return False
    return not _hooked(_modules_of(model, _watched(model)))


def _modules_of(model: nn.Module, watched: list) -> list[nn.Module]:
    """``model`` and every module among the ``watched`` items: the ones whose hooks ``_hooked`` asks about."""
    return [model] + [item for _, _, item in watched if isinstance(item, nn.Module)]


def _hooked(modules: list[nn.Module]) -> bool:
    """Whether any forward hook would run: the fused step calls no module, so it would skip them."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _watched(model: nn.Module) -> list[tuple[dict, str, object]]:
    """(table, name, item) for every submodule and parameter, so that one replaced after the
    table was built (a LoRA layer swapped in, a weight assigned anew) is noticed before a
    step reads through stale pointers."""
    return [(table, name, item) for module in model.modules()
            for table in (module._modules, module._parameters) for name, item in table.items()]


def _weight_table(model: nn.Module) -> Optional[torch.Tensor]:
    """[n_layers, 14] int64: each layer's weight pointers and leading dimensions (columns 10-13,
    the K/V destinations, are filled per step), or None when a weight is not fp32 CPU memory
    laid out as the kernel reads it."""
    for p in model.parameters():
        if p.dtype != torch.float32 or p.device.type != "cpu":
            return None
    head = model.lm_head.weight
    if not (row_major(head) and _contiguous(model.norm.weight)) or model.embed_tokens.weight.dim() != 2:
        return None
    rows = []
    for layer in model.layers:
        attention, mlp = layer.attention, layer.mlp
        qkv = joint_weight([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
        gate_up = joint_weight([mlp.gate.weight, mlp.up.weight])
        o, down = attention.o_proj.weight, mlp.down.weight
        norms = (layer.input_norm.weight, layer.post_attention_norm.weight)
        if qkv is None or gate_up is None or not (row_major(o) and row_major(down)) or not all(map(_contiguous, norms)):
            return None
        rows.append([norms[0].data_ptr(), qkv.data_ptr(), qkv.stride(0), o.data_ptr(), o.stride(0),
                     norms[1].data_ptr(), gate_up.data_ptr(), gate_up.stride(0), down.data_ptr(), down.stride(0)]
                    + [0] * (COLUMNS - 10))  # the K/V destinations, filled per step
    return torch.tensor(rows, dtype=torch.int64)


def _contiguous(weight: torch.Tensor) -> bool:
    return weight.dim() == 1 and weight.is_contiguous()
