"""Weight-only int8 and int4 linears in llama.cpp's Q8_0, Q4_0 and Q4_1 numbers.

Weights are cut into blocks of 32 along the input dimension, each with one fp16
scale; int8 keeps a signed byte per weight, int4 a nibble (two per byte). The
numbers are GGUF's exactly, so a Q8_0/Q4_0/Q4_1 tensor of a GGUF file is split into
``qweight``/``scales`` without requantizing, and a model quantized here holds what
llama.cpp would hold. int4 has two forms: "int4" (Q4_0: (nibble - 8) * d, a grid
symmetric about zero) and "int4-asym" (Q4_1: nibble * d + m, the block's minimum m kept
as well: two more bytes per 32 weights, and any block's range fits its 16 levels), whose
``scales`` hold a row's d's followed by its m's. Both multiply activations rounded to Q8_0
blocks (``quantize_activations``), as llama.cpp does for Q8_0 and Q4_0: the CPU kernels then
sum int8 x int8 and int4 x int8 products in integers, far cheaper than widening every weight
to a float (which left a decode step bound by arithmetic rather than by reading the weights). ``QuantizedLinear.forward`` is the plain
PyTorch reference that fast kernels are checked against, that rounding included.

What ``quantize_model`` quantizes: every linear of the transformer blocks (attention
and MLP projections, experts included) in the requested format, except MoE routers,
which are tiny and decide which experts run; and the output head always as int8 (as
llama.cpp keeps its output at higher precision than Q4_0). The token embedding stays
float: a lookup reads one row per token, so its size costs memory, not time. A head
tied to the embedding stays tied: its int8 blocks are the one copy of the table, which the
embedding looks up dequantized (``tie_quantized_head``), so a directory stores the table
once, as llama.cpp's file does, and the logical parameter count does not change.

A quantized model quantizes again from the numbers its blocks hold (``dequantize_model``,
then ``quantize_model``): a GGUF's Q4_1 file, say, becomes int8 or int4 without its
float original, at the cost of rounding twice.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from astrai.errors import CheckpointError, ConfigError
from astrai.model.components.layers import Linear
from astrai.model.int4_scales import quantize_int4_weighted

GROUP_SIZE = 32
FORMATS = {"int8": 8, "int4": 4, "int4-asym": 4}
ASYMMETRIC = "int4-asym"
NOT_INT4 = "only int4 has an asymmetric form (a minimum beside each block's scale)"
NOT_CALIBRATED = "calibrated scales are for int4's symmetric form; int4-asym keeps each block's range"
HEAD_BITS = 8
SKIPPED_NAMES = ("router",)


def _check_bits(bits: int) -> None:
    if bits not in (8, 4):
        raise ConfigError(f"quantized weights have 8 or 4 bits, not {bits!r}")


def format_bits(name: str) -> int:
    """The bits of a format name ("int8" → 8, "int4" → 4); anything else is a ConfigError."""
    if name not in FORMATS:
        raise ConfigError(f"unknown quantization {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero without the error of floor(|x| + 0.5) (ggml's roundf)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def quantize_weight(weight: torch.Tensor, bits: int, asymmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scales) of a float [out, in] weight, as GGUF's Q8_0 (bits 8), Q4_0 (bits 4) or,
    ``asymmetric``, Q4_1 (bits 4; scales [out, 2 * blocks]: the d's, then the minimums).

    The input dimension is zero-padded to a multiple of 32. Values are computed in float32
    as ggml does (multiplying by the scale's reciprocal), so the bytes equal ggml's.
    """
    _check_bits(bits)
    if asymmetric and bits != 4:
        raise ConfigError(NOT_INT4)
    if weight.dim() != 2:
        raise ConfigError(f"quantize_weight takes a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    padded = -(-in_features // GROUP_SIZE) * GROUP_SIZE
    w = F.pad(weight.detach().to(torch.float32), (0, padded - in_features))
    blocks = w.reshape(out_features, padded // GROUP_SIZE, GROUP_SIZE)
    if bits == 8:
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        qweight = _round_half_away(blocks * inverse).to(torch.int8).reshape(out_features, padded)
    elif asymmetric:
        low, high = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
        d = (high - low) / 15
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.floor((blocks - low) * inverse + 0.5).clamp(0, 15).to(torch.uint8)
        qweight = (q[..., :16] | (q[..., 16:] << 4)).reshape(out_features, padded // 2)
        scales = torch.cat((d.squeeze(-1), low.squeeze(-1)), dim=1).to(torch.float16)
        return qweight.contiguous(), scales.contiguous()
    else:
        largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
        d = largest / -8
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(blocks * inverse + 8.5).clamp(0, 15).to(torch.uint8)
        qweight = (q[..., :16] | (q[..., 16:] << 4)).reshape(out_features, padded // 2)
    return qweight.contiguous(), d.squeeze(-1).to(torch.float16).contiguous()


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded along its last dimension to Q8_0 blocks, as the quantized matmuls multiply it.

    Per block of 32 (the last one zero-padded): d = max|x| * (1/127) in float32, q = x / d
    rounded to the nearest integer (ties to even), and q times d rounded to fp16. Returned
    as float values in ``x``'s dtype; applying it again changes nothing.
    """
    n = x.shape[-1]
    padded = -(-n // GROUP_SIZE) * GROUP_SIZE
    blocks = F.pad(x.detach().to(torch.float32), (0, padded - n)).reshape(*x.shape[:-1], padded // GROUP_SIZE,
                                                                         GROUP_SIZE)
    d = blocks.abs().amax(dim=-1, keepdim=True) * (1.0 / 127.0)
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    rounded = torch.round(blocks * inverse) * d.to(torch.float16).to(torch.float32)
    return rounded.reshape(*x.shape[:-1], padded)[..., :n].to(x.dtype)


def is_asymmetric(qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether (qweight, scales) are int4 blocks with minimums (Q4_1): two fp16 values per block."""
    return qweight.dtype == torch.uint8 and scales.shape[-1] == 2 * (qweight.shape[-1] * 2 // GROUP_SIZE)


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """The float32 [out, in_features] weight that (qweight, scales) stand for."""
    _check_bits(bits)
    out_features = qweight.shape[0]
    if bits == 8:
        groups = qweight.shape[1] // GROUP_SIZE
        values = qweight.to(torch.float32).reshape(out_features, groups, GROUP_SIZE)
        weight = values * scales.to(torch.float32).unsqueeze(-1)
    else:
        groups = qweight.shape[1] * 2 // GROUP_SIZE
        packed = qweight.reshape(out_features, groups, GROUP_SIZE // 2)
        values = torch.cat((packed & 15, packed >> 4), dim=-1).to(torch.float32)
        scales = scales.to(torch.float32)
        if is_asymmetric(qweight, scales):
            weight = values * scales[:, :groups].unsqueeze(-1) + scales[:, groups:].unsqueeze(-1)
        else:
            weight = (values - 8) * scales.unsqueeze(-1)
    return weight.reshape(out_features, groups * GROUP_SIZE)[:, :in_features]


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is held as int8 or int4 blocks with fp16 scales.

    ``forward`` dequantizes and multiplies in the input's dtype, the input rounded by
    ``quantize_activations`` first: slow, but the exact reference. Casting the module (``model.to(torch.bfloat16)``) leaves the packed
    weight, the fp16 scales and the fp32 bias as they are, since they are the format.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, bias: bool = False,
                 device: Optional[torch.device | str] = None, asymmetric: bool = False):
        super().__init__()
        _check_bits(bits)
        if asymmetric and bits != 4:
            raise ConfigError(NOT_INT4)
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, GROUP_SIZE
        padded = -(-in_features // GROUP_SIZE) * GROUP_SIZE
        qdtype, qwidth = (torch.int8, padded) if bits == 8 else (torch.uint8, padded // 2)
        per_block = 2 if asymmetric else 1
        self.register_buffer("qweight", torch.zeros(out_features, qwidth, dtype=qdtype, device=device))
        self.register_buffer("scales", torch.zeros(out_features, per_block * padded // GROUP_SIZE, dtype=torch.float16,
                                                   device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None)

    @property
    def asymmetric(self) -> bool:
        """Whether the blocks hold Q4_1's minimums beside their scales."""
        return is_asymmetric(self.qweight, self.scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, importance: Optional[torch.Tensor] = None,
                    asymmetric: bool = False) -> "QuantizedLinear":
        """``linear`` quantized; for int4, ``importance`` (its inputs' mean square per channel,
        astrai/model/calibration.py) picks each block's scale instead of Q4_0's rule, and
        ``asymmetric`` takes Q4_1's numbers (each block's minimum and step) instead."""
        if asymmetric and importance is not None:
            raise ConfigError(NOT_CALIBRATED)
        module = cls(linear.in_features, linear.out_features, bits, bias=False, device=linear.weight.device,
                     asymmetric=asymmetric)
        if asymmetric:
            module.qweight, module.scales = quantize_weight(linear.weight, bits, asymmetric=True)
        elif bits == 4 and importance is not None:
            module.qweight, module.scales = (t.to(linear.weight.device) for t in
                                             quantize_int4_weighted(linear.weight.cpu(), importance.cpu()))
        else:
            module.qweight, module.scales = quantize_weight(linear.weight, bits)
        if linear.bias is not None:
            module.bias = linear.bias.detach().to(torch.float32).clone()
        return module

    def dequantize(self) -> torch.Tensor:
        return dequantize_weight(self.qweight, self.scales, self.bits, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(quantize_activations(x), self.dequantize().to(x.dtype), bias)

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers[name] for name in ("scales", "bias") if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, original in kept.items():
            moved = self._buffers[name]
            if moved.dtype != original.dtype:  # a dtype cast: keep the format's dtype, follow the device
                self._buffers[name] = original.to(moved.device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits}{' asymmetric' if self.asymmetric else ''}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


def quantization_targets(model: nn.Module, bits: int) -> Iterator[tuple[str, int]]:
    """(module name, bits) for each linear ``quantize_model`` replaces: the blocks' linears
    in ``bits`` (routers skipped) and the output head in int8."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name == "lm_head":
            yield name, HEAD_BITS
        elif name.startswith("layers.") and not name.endswith(SKIPPED_NAMES):
            yield name, bits


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model(model: nn.Module, format: str, importance: Optional[dict[str, torch.Tensor]] = None,
                   progress: Optional[Callable[[int], None]] = None) -> nn.Module:
    """Replace ``model``'s linears by QuantizedLinear ("int8" or "int4", see the module
    docstring for which ones) in place, and return it.

    ``importance`` ({linear name: its inputs' mean square per channel}, from
    astrai/model/calibration.py's ``calibrate``) makes the int4 linears calibrated: each
    block's scale minimises the output-weighted error instead of following Q4_0's rule.
    The model remembers its format (``model.quantization``), which ``save_pretrained``
    writes to config.json. An already quantized model is dequantized first (``dequantize_model``).
    ``progress`` is called with 1 after each linear (``quantization_targets`` lists them).
    """
    bits = format_bits(format)
    asymmetric = format == ASYMMETRIC
    if asymmetric and importance is not None:
        raise ConfigError(NOT_CALIBRATED)
    if getattr(model, "quantization", None):
        dequantize_model(model)
    targets = list(quantization_targets(model, bits))
    for name, target_bits in targets:
        weights = None if importance is None else importance.get(name)
        _replace(model, name, QuantizedLinear.from_linear(model.get_submodule(name), target_bits, weights,
                                                          asymmetric=asymmetric and target_bits == 4))
        if progress is not None:
            progress(1)
    if _tied(model):
        model.tie_weights()
    model.quantization = {"format": format, "group_size": GROUP_SIZE}
    if importance is not None and bits == 4:
        model.quantization["calibrated"] = True
    return model


def _tied(model: nn.Module) -> bool:
    """Whether ``model``'s head and token embedding share one table (a Transformer whose config ties them)."""
    tied = bool(getattr(getattr(model, "config", None), "tie_weight", False))
    return tied and hasattr(model, "embed_tokens") and hasattr(model, "lm_head")


def tie_quantized_head(embedding: nn.Embedding, head: QuantizedLinear) -> None:
    """Make ``embedding`` look up the rows ``head``'s blocks hold (a tied head is the table's one copy),
    in the embedding's dtype, on the head's device."""
    dtype = embedding.weight.dtype if embedding.weight.is_floating_point() else torch.float32
    embedding.weight = nn.Parameter(head.dequantize().to(dtype), requires_grad=embedding.weight.requires_grad)


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace ``model``'s QuantizedLinears by float linears holding the weights their blocks stand
    for, in place, and return it: the float model a quantized one (an imported GGUF, say) is
    quantized again from. A tied head shares the embedding's tensor again."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tied = _tied(model)
    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantizedLinear):
            continue
        linear = Linear(module.in_features, module.out_features, bias=module.bias is not None,
                        device=module.qweight.device, dtype=dtype)
        if not (tied and name == "lm_head"):  # a tied head takes the embedding's table, which already holds it
            linear.weight.data = module.dequantize().to(dtype)
        if module.bias is not None:
            linear.bias.data = module.bias.to(dtype)
        _replace(model, name, linear)
    if tied:
        model.tie_weights()
    model.quantization = None
    return model


def cast_linear_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast only the float linears' weights to ``dtype`` (e.g. bf16), in place, and return ``model``.

    A decode step's time is the time to read the linear weights, so that is where a
    smaller dtype pays; the embedding, norms and biases stay as they are, and with them
    the activations and the KV cache, which lets the CPU's fused decode step (fp32
    activations) read bf16 weights. A head tied to the embedding gets its own cast copy.
    The result is meant for the inference engine's CPU runner, whose linears take a
    weight of another dtype than their input (and multiply it rounded to bf16, W16A16, as
    llama.cpp's BF16 matmuls do); the plain forward needs one dtype throughout.
    """
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if type(module) is QuantizedLinear or not isinstance(module, nn.Linear) or module.weight.dtype == dtype:
            continue
        if id(module.weight) in embedding_weights:
            module.weight = nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
            config = getattr(model, "config", None)
            if config is not None and getattr(config, "tie_weight", False):
                config.tie_weight = False
        else:
            module.weight.data = module.weight.data.to(dtype)
    return model


def install_quantized_layout(model: nn.Module, state: dict[str, torch.Tensor], quantization: dict, source) -> None:
    """Give ``model`` an empty QuantizedLinear wherever ``state`` holds a ``<name>.qweight``
    (int8: 8 bits, uint8: 4 bits), so the state loads into it by name."""
    for key, tensor in state.items():
        if not key.endswith(".qweight"):
            continue
        name = key[: -len(".qweight")]
        scales = state.get(f"{name}.scales")
        if tensor.dtype not in (torch.int8, torch.uint8) or scales is None or scales.dtype != torch.float16:
            raise CheckpointError(f"{source}: '{key}' must be int8 or uint8 with float16 '{name}.scales' beside it, "
                                  f"found {tensor.dtype} and {None if scales is None else scales.dtype}")
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            continue  # left to the loader's "unexpected weights" report
        if not isinstance(linear, nn.Linear):
            continue
        bits = 8 if tensor.dtype == torch.int8 else 4
        _replace(model, name, QuantizedLinear(linear.in_features, linear.out_features, bits,
                                              bias=linear.bias is not None, device="meta",
                                              asymmetric=is_asymmetric(tensor, scales)))  # filled by the load
    model.quantization = dict(quantization)
