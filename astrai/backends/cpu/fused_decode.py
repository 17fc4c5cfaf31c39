"""A single request's decode step in one call into C, for the models it fits.

With one row, a decode step of a small model is mostly not arithmetic: each layer's norms,
rotary embedding, K/V writes, SiLU and residuals are some 60 PyTorch operator calls on a
few hundred floats, each a few microseconds with the Python around it.
``native/decode_step.c`` does the whole step - embedding row, every layer, final norm,
head - in one call, between the same one-row GEMVs and decode attention the unfused
step uses, so the step costs what streaming the weights costs.

It fits GQA attention (with or without q/k/v biases and QK-norm; no output gate) and dense
SwiGLU feed-forwards, activations, norms and embedding in fp32 on the CPU, a KV cache in fp32,
bf16 or fp16 (``kv_cache_dtype``: rounded as the step writes it, widened as it reads it), linear
weights in fp32, bf16 or int8/int4 blocks (QuantizedLinear), mixed as they come (each weight's
type is a column of the C step's table), with q/k/v (and their biases) and gate/up each
stacked in one buffer (as serving.py prepares them), a tied or untied head of any of those
types, no LoRA layers and no hooks, and the C kernels built. ``FusedDecode.for_model`` says None for anything else, and a step with several rows
takes the usual forward; ``ASTRAI_FUSED_DECODE=0`` turns it off. The first step after a
prefill is fused too: the runner's ``decode_target`` copies the prompt's K/V from the pages
into the decode buffers first. When a request's steps begin, the weights' addresses are
compared with those the table was built from (``ready``), so a model changed in place
(weights reloaded, cast, re-laid, LoRA layers or hooks added) is checked again instead of
read through stale pointers; later steps of the same request reuse the answer, since the
check reads a thousand Python objects that the streamed weights have pushed out of the
caches (half a millisecond, a tenth of a small model's step). A change made while a request
runs is followed from the next request, or at once after ``recheck`` (the runner's
``load_weights``); the table holds the tensors it points into, so memory such a change
frees is never read.

The runner goes straight from the cache to the kernel (no ``KvcacheView``), and the C
step's plan (kernels.DecodePlan: the table of pointers, rotary rows, scratch memory) is
made again only when the decode buffers are replaced: the Python of a step is part of its
time. The step also returns the logits' argmax, which a greedy request's sampling takes.
A lone greedy request takes several steps per call (``greedy_steps``), each step's argmax
the next one's token, so the checks above and the scheduler's bookkeeping run once per
run of steps, not once a step. A speculative decoder's check of its drafted tokens
(``verify``) is one call too: the row's last token and the drafts, each weight read once
for all of them; and a greedy row drafting with a draft head or by prompt lookup takes runs
of such steps (``speculative_steps``), the drafts and their acceptance made in C between them.
"""

from __future__ import annotations

import operator
import os
from typing import Optional, Sequence

import torch
from torch import nn

from astrai.backends.cpu.decode_buffers import RowTarget
from astrai.backends.cpu.kernels import (MAX_VERIFY_TOKENS, DecodePlan, SpeculativeSteps, TypedWeight, decode_plan,
                                         decode_step, decode_steps, kernels_available, kv_kind, speculative_steps,
                                         verify_step)
from astrai.backends.cpu.serving import (InterleavedQuantizedLinear, ServingGQA, ServingLinear, ServingMLP,
                                         ServingQuantizedLinear, typed_weight)
from astrai.model.components.layers import Embedding, Linear, RMSNorm, rotary_tables
from astrai.model.quantized import QuantizedLinear

# a stacked group's members stay Linear; the rest are served
PLAIN_LINEARS = (Linear, ServingLinear, QuantizedLinear, ServingQuantizedLinear, InterleavedQuantizedLinear)


class FusedDecode:
    """Runs one-row decode steps of ``model`` through ``native/decode_step.c``."""

    def __init__(self, model: nn.Module):
        self.model = model
        config = model.config
        self.dims = (config.dim, config.n_heads, config.n_kv_heads, config.resolved_head_dim, config.dim_ffn)
        self.eps = float(config.norm_eps)
        self.scale = config.resolved_head_dim ** -0.5
        self._seen = _Snapshot(model)
        self._addresses: Optional[list[int]] = None  # the weights' addresses when the table was last built
        self._static: Optional[torch.Tensor] = None
        self._head: Optional[TypedWeight] = None
        self._held: tuple = ()  # aliases of the tensors _static points into: their memory outlives a swap
        self._builds = 0  # of _static: a plan made from an earlier one is stale
        self._plan: Optional[DecodePlan] = None  # _static with the current buffers' columns, rotary rows, scratch
        self._plan_key: Optional[tuple] = None
        self._vocab = 0  # the embedding's rows: the tokens the step may look up
        self._trusted: Optional[str] = None  # the request whose steps reuse the last check's yes
        self._slot_strides = (0, 0)  # elements between page slots in the K and V stores

    @classmethod
    def for_model(cls, model: nn.Module) -> Optional["FusedDecode"]:
        """A fused decoder for ``model``, or None when the model is not of the shape it handles
        (or ``$ASTRAI_FUSED_DECODE`` is 0, which keeps every step on the model's own forward)."""
        if os.environ.get("ASTRAI_FUSED_DECODE", "1") == "0" or not kernels_available() or not _plain_structure(model):
            return None
        fused = cls(model)
        return fused if fused.ready() else None

    def __call__(self, token: int, target: RowTarget) -> Optional[tuple[torch.Tensor, int]]:
        """Logits [1, vocab] of one decode step of one row whose new token is ``token``, its K/V
        written where ``target`` (``CpuModelRunner.decode_target``) says, and the index of their maximum
        (``torch.argmax``'s); None when the step does not qualify (the caller runs the usual
        forward). Call when ``ready()`` has just said True."""
        plan = self._checked_plan(token, target)
        if plan is None:
            return None
        k_stride, v_stride = self._slot_strides
        logits, best = decode_step(plan, token, target.pos, (target.slot * k_stride, target.slot * v_stride))
        return logits.view(1, -1), best

    def greedy_steps(self, token: int, target: RowTarget, stop_ids: Sequence[int],
                     max_seconds: float = float("inf")) -> Optional[list[int]]:
        """``len(target.slots)`` greedy steps in one call, each taking the last one's argmax as
        its token (``kernels.decode_steps``): the tokens, fewer when one is in
        ``stop_ids`` or once the steps have taken ``max_seconds``; None when the steps do not
        qualify (the caller takes single steps). Call when ``ready()`` has just said True."""
        plan = self._checked_plan(token, target)
        if plan is None:
            return None
        k_stride, v_stride = self._slot_strides
        tokens = decode_steps(plan, token, target.pos, [(slot * k_stride, slot * v_stride) for slot in target.slots],
                              stop_ids, self._vocab, max_seconds)
        if len(tokens) < len(target.slots):
            target.ran(len(tokens))
        return tokens

    def verify(self, tokens: Sequence[int], target: RowTarget) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Logits [n, vocab] and final hidden states [n, dim] of ``n`` consecutive tokens of one row
        in one call (``kernels.verify_step``: the weights read once for all of them), their K/V
        written where ``target`` says (one slot per token); None when the step does not qualify
        (the caller runs the usual forward).
        Call when ``ready()`` has just said True."""
        if not 1 <= len(tokens) <= MAX_VERIFY_TOKENS or len(tokens) != len(target.slots):
            return None
        plan = self._checked_plan(max(tokens), target) if min(tokens) >= 0 else None
        if plan is None:
            return None
        k_stride, v_stride = self._slot_strides
        return verify_step(plan, tokens, target.pos, [(slot * k_stride, slot * v_stride) for slot in target.slots])

    def speculative_steps(self, token: int, target: RowTarget, drafter, hidden: Optional[torch.Tensor],
                          stop_ids: Sequence[int], max_seconds: float, drafting: dict) -> Optional[SpeculativeSteps]:
        """Up to ``len(target.slots)`` tokens of a greedy row from verify steps in one call, each
        drafting with ``drafter`` (a draft head's ``HeadPlan``, or prompt lookup's ``(context,
        min_n, max_n)``; ``kernels.speculative_steps``, whose drafting arguments ``drafting``
        holds), ending as ``greedy_steps`` ends and when the row's kept fraction falls below its
        floor; None when the steps do not qualify. Call when ``ready()`` has just said True."""
        plan = self._checked_plan(token, target)
        if plan is None:
            return None
        if hasattr(drafter, "threads"):
            drafter.threads = plan.threads
        k_stride, v_stride = self._slot_strides
        steps = speculative_steps(plan, drafter, token, target.pos,
                                  [(slot * k_stride, slot * v_stride) for slot in target.slots], hidden, stop_ids,
                                  self._vocab, max_seconds, **drafting)
        if len(steps.tokens) < len(target.slots):
            target.ran(len(steps.tokens))
        return steps

    def _checked_plan(self, token: int, target: RowTarget) -> Optional[DecodePlan]:
        """``_plan_for(target)``, or None when the token has no embedding row or a step's position
        lies outside the buffers: the model's own forward reports those, where C would read or
        write out of bounds."""
        if not (0 <= token < self._vocab and 0 <= target.pos and target.pos + len(target.slots) <= target.capacity):
            return None
        return self._plan_for(target)

    def _plan_for(self, target: RowTarget) -> Optional[DecodePlan]:
        """The C step's plan for ``target``'s buffers and page store, made again only when the
        buffers were replaced, the weights' table was rebuilt or torch's thread count changed;
        None when the cache is not CPU memory of a dtype and layout the kernel reads."""
        buffers, storage = target.buffers, target.storage
        threads = max(torch.get_num_threads(), 1)
        key = (buffers, buffers.generation, storage, self._builds, threads)  # held, so no id is ever reused
        if key != self._plan_key:
            self._plan_key, self._plan = key, self._make_plan(buffers, storage, target.capacity, threads)
        return self._plan

    def _make_plan(self, buffers, storage, capacity: int, threads: int) -> Optional[DecodePlan]:
        table = _with_cache_columns(self._static, buffers, storage)
        if table is None:
            return None
        self._slot_strides = (storage.k_cache.stride(1), storage.v_cache.stride(1))
        model = self.model
        positions = torch.arange(capacity).unsqueeze(0)
        cos, sin = model.rotary_embedding(torch.empty(1, capacity, 0), positions)
        cos, sin = rotary_tables(cos, sin, torch.float32)
        return decode_plan(model.embed_tokens.weight, table, self.dims, cos.reshape(capacity, -1).contiguous(),
                           sin.reshape(capacity, -1).contiguous(), capacity, self.eps, self.scale, model.norm.weight,
                           self._head, threads, storage.k_cache.dtype)

    def ready(self, task_id: Optional[str] = None) -> bool:
        """Whether the table of weight pointers is current: rebuilt (and checked) when a module
        or parameter was replaced, or a weight moved, cast or re-laid, since it was made. A
        model found not to fit is checked again only after such a change, not every step. A
        yes for request ``task_id`` holds for its later steps, until ``recheck``."""
        if task_id is not None and task_id == self._trusted:
            return True
        self._trusted = None
        if self._check():
            self._trusted = task_id
            return True
        return False

    def recheck(self) -> None:
        """Check the model again at the next step (its weights were just loaded)."""
        self._trusted = None

    def _check(self) -> bool:
        seen = self._seen
        if seen.replaced():
            seen = self._seen = _Snapshot(self.model)
            self._addresses = None
        if seen.hooked():
            return False
        if seen.addresses() == self._addresses:
            return self._static is not None
        tables = _weight_table(self.model) if _plain_structure(self.model) else None
        self._static, self._head, self._held = tables if tables is not None else (None, None, ())
        self._builds += 1
        self._addresses = seen.addresses()
        if self._static is not None:
            self._vocab = self.model.embed_tokens.weight.shape[0]
        return self._static is not None


class _Snapshot:
    """The model's modules and parameters as the table was built from them, in flat lists, so
    that the check before every step runs in C-level builtins rather than a Python loop."""

    def __init__(self, model: nn.Module):
        watched = _watched(model)
        self._tables = [table for table, _, _ in watched]
        self._names = [name for _, name, _ in watched]
        self._items = [item for _, _, item in watched]
        modules = [model] + [item for item in self._items if isinstance(item, nn.Module)]
        self._hook_tables = [m._forward_hooks for m in modules] + [m._forward_pre_hooks for m in modules]
        self._parameters = list(model.parameters()) + list(model.buffers())  # quantized weights are buffers

    def replaced(self) -> bool:
        """Whether a submodule or parameter was replaced (or removed) since the snapshot."""
        return any(map(operator.is_not, map(dict.get, self._tables, self._names), self._items))

    def hooked(self) -> bool:
        """Whether any forward hook would run: the fused step calls no module, so it would skip them."""
        module = nn.modules.module
        return bool(module._global_forward_hooks or module._global_forward_pre_hooks or any(map(len, self._hook_tables)))

    def addresses(self) -> list[int]:
        return list(map(torch.Tensor.data_ptr, self._parameters))


def _plain_structure(model: nn.Module) -> bool:
    """A Transformer of GQA + SwiGLU blocks with no options the C step leaves out, and no hooks."""
    config = getattr(model, "config", None)
    layers = getattr(model, "layers", None)
    if config is None or layers is None or not all(hasattr(model, n) for n in ("embed_tokens", "norm", "lm_head")):
        return False
    if (config.attn_type != "gqa" or config.use_gated_attention
            or config.n_heads % config.n_kv_heads or config.resolved_head_dim % 2):
        return False
    if (type(model.embed_tokens) is not Embedding or type(model.norm) is not RMSNorm
            or type(model.lm_head) not in PLAIN_LINEARS):
        return False
    for layer in layers:
        attention, mlp = getattr(layer, "attention", None), getattr(layer, "mlp", None)
        if type(attention) is not ServingGQA or type(mlp) is not ServingMLP:
            return False
        if type(layer.input_norm) is not RMSNorm or type(layer.post_attention_norm) is not RMSNorm:
            return False
        if attention.use_qk_norm and not (type(attention.q_norm) is RMSNorm and type(attention.k_norm) is RMSNorm):
            return False
        qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        others = (attention.o_proj, mlp.gate, mlp.up, mlp.down)
        if any(type(m) not in PLAIN_LINEARS for m in qkv + others) or any(m.bias is not None for m in others):
            return False
        if any(m.bias is not None for m in qkv) and attention.joint.bias is None:  # biases not stacked
            return False
    return not _Snapshot(model).hooked()


def _watched(model: nn.Module) -> list[tuple[dict, str, object]]:
    """(table, name, item) for every submodule, parameter and buffer, so that one replaced after the
    table was built (a LoRA layer swapped in, a weight assigned anew) is noticed before a
    step reads through stale pointers."""
    return [(table, name, item) for module in model.modules()
            for table in (module._modules, module._parameters, module._buffers) for name, item in table.items()]


def _weight_table(model: nn.Module) -> Optional[tuple[torch.Tensor, TypedWeight, tuple]]:
    """[n_layers, COLUMNS] int64: each layer's norms, biases and weights (columns 5-8, the K/V
    stores and buffers, are filled by ``_with_cache_columns``), the head, and aliases of every
    tensor the table points into (held, so that a tensor swapped out of the model is not freed
    while the table may still be read); or None when a weight is not CPU memory of a type and
    layout the kernel reads, or anything but the linear weights is not fp32."""
    for name, p in model.named_parameters():
        if p.device.type != "cpu" or (p.dtype != torch.float32 and not (p.dtype == torch.bfloat16 and p.dim() == 2
                                                                        and ".embed_tokens." not in f".{name}")):
            return None
    head = _checked(typed_weight(model.lm_head))
    embedding = model.embed_tokens.weight
    if head is None or not _contiguous(model.norm.weight) or embedding.dim() != 2 or embedding.dtype != torch.float32:
        return None
    rows, held = [], [embedding.detach(), model.norm.weight.detach(), head.data.detach()]
    held += [] if head.scales is None else [head.scales.detach()]
    for layer in model.layers:
        attention, mlp = layer.attention, layer.mlp
        weights = [_checked(attention.joint.typed_weight()), _checked(typed_weight(attention.o_proj)),
                   _checked(mlp.joint.typed_weight()), _checked(typed_weight(mlp.down))]
        vectors = [layer.input_norm.weight, layer.post_attention_norm.weight]
        bias = attention.joint.bias if attention.q_proj.bias is not None else None
        qk_norms = (attention.q_norm.weight, attention.k_norm.weight) if attention.use_qk_norm else (None, None)
        optional = [bias, *qk_norms]
        if (None in weights or not all(map(_contiguous, vectors + [v for v in optional if v is not None]))
                or any(v is not None and v.dtype != torch.float32 for v in optional)):
            return None
        rows.append([v.data_ptr() for v in vectors] + [0 if v is None else v.data_ptr() for v in optional]
                    + [0] * 4  # the K/V stores and buffers: _with_cache_columns
                    + [value for weight in weights for value in weight.pointers()])
        held += [t.detach() for t in vectors + optional if t is not None]
        held += [t.detach() for weight in weights for t in (weight.data, weight.scales) if t is not None]
    return torch.tensor(rows, dtype=torch.int64), head, tuple(held)


def _checked(weight: Optional[TypedWeight]) -> Optional[TypedWeight]:
    try:
        return None if weight is None else weight.check()
    except ValueError:
        return None


def _with_cache_columns(static: torch.Tensor, buffers, storage) -> Optional[torch.Tensor]:
    """``static`` with columns 5-8 filled: each layer's K/V page store and the decode
    buffers' row 0 for K/V; None unless all of them are contiguous CPU tensors of one dtype
    the kernels read (fp32, bf16, fp16: ``kv_kind``) and of the widths the kernel assumes."""
    k_cache, v_cache = storage.k_cache, storage.v_cache
    tensors = [k_cache, v_cache, *buffers.k, *buffers.v]
    if kv_kind(k_cache.dtype) is None or not all(t.dtype == k_cache.dtype and t.device.type == "cpu"
                                                 and t.is_contiguous() for t in tensors):
        return None
    if not buffers.k or buffers.k[0].shape[-1] != storage.k_width or buffers.v[0].shape[-1] != storage.v_width:
        return None
    table = static.clone()
    table[:, 5] = torch.tensor([k_cache[layer].data_ptr() for layer in range(len(table))])
    table[:, 6] = torch.tensor([v_cache[layer].data_ptr() for layer in range(len(table))])
    table[:, 7] = torch.tensor([b.data_ptr() for b in buffers.k])
    table[:, 8] = torch.tensor([b.data_ptr() for b in buffers.v])
    return table


def _contiguous(weight: torch.Tensor) -> bool:
    return weight.dim() == 1 and weight.is_contiguous()
