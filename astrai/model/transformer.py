"""Transformer: the decoder-only language model at the centre of astrai."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from astrai.config import ModelConfig
from astrai.errors import DataError
from astrai.model.automodel import AutoModel
from astrai.model.components import DecoderBlock, DeepSeekMoE, Embedding, Linear, RMSNorm, RotaryEmbedding
from astrai.model.quantized import QuantizedLinear, tie_quantized_head
from astrai.model.components.layers import rotary_tables, select_positions
from astrai.model.components.attention import AttnFactory
from astrai.model.components.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy


def build_attention_mask(input_mask: Optional[torch.Tensor], seq_len: int, device) -> Optional[torch.Tensor]:
    """Combine causality with an optional padding or document mask.

    ``input_mask`` is either [B, T] (1 = real token, 0 = padding) or [B, T, T]
    (True where query t may see key s, e.g. same packed document). The result is
    always causal: the extra mask can only remove keys. Each query keeps its own
    position so fully padded rows stay finite. None means "plain causal".
    """
    if input_mask is None:
        return None
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if input_mask.dim() == 2:
        allowed = causal & input_mask.to(torch.bool)[:, None, :]
    elif input_mask.dim() == 3:
        allowed = causal & input_mask.to(torch.bool)
    else:
        raise ValueError(f"input_mask must be [B, T] or [B, T, T], got shape {tuple(input_mask.shape)}")
    allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=device)
    return allowed.unsqueeze(1)


@AutoModel.register("transformer")
class Transformer(AutoModel):
    """Embedding → DecoderBlocks → RMSNorm → lm_head.

    ``forward`` returns a dict: ``logits`` [B, T, V] (or [B, 1, V] when
    ``logits_index`` [B] picks one position per row, [B, R, V] when [B, R] picks R of
    each), ``hidden_states`` (the final normed
    hidden states, used by reward heads) and, for MoE models in training mode,
    ``aux_loss`` (the summed load-balancing loss). Given ``target_ids`` it returns
    ``loss`` (mean next-token cross-entropy over targets other than -100) instead of
    ``logits``, computed without ever holding the [B, T, V] logits (see
    linear_cross_entropy.py). With ``compute_logits=False`` it returns ``hidden_states``
    alone, for a caller that applies ``lm_head`` to a few positions at a time.
    """

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        rope_dim = config.qk_rope_head_dim if config.attn_type == "mla" else config.resolved_head_dim
        self.rotary_embedding = RotaryEmbedding(rope_dim, config.max_len, config.rope_theta, config.rope_scaling)
        self.embed_tokens = Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = Linear(config.dim, config.vocab_size)
        self.tie_weights()
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        """One table for both ends; a quantized tied head holds it as blocks that the embedding looks up dequantized."""
        if not self.config.tie_weight:
            return
        if isinstance(self.lm_head, QuantizedLinear):
            tie_quantized_head(self.embed_tokens, self.lm_head)
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; output projections scaled by 1/sqrt(2·n_layers)
        so the residual stream's variance does not grow with depth."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_output = name.endswith(("o_proj", "down"))
                nn.init.normal_(module.weight, mean=0.0, std=out_std if is_output else std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Per-token shapes (heads, width) of the two tensors each layer stores in a KV cache."""
        return AttnFactory.get(self.config.attn_type).cache_shapes(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        input_mask: Optional[torch.Tensor] = None,
        paged_cache=None,
        position_ids: Optional[torch.Tensor] = None,
        logits_index: Optional[torch.Tensor] = None,
        target_ids: Optional[torch.Tensor] = None,
        label_smoothing: float = 0.0,
        compute_logits: bool = True,
    ) -> dict[str, torch.Tensor]:
        B, T = input_ids.shape
        # past max_len the RoPE scaling and any imported window no longer hold; with a paged cache the
        # positions are the cache's (a step may lay several requests' tokens out in one row)
        if paged_cache is None and T > self.config.max_len:
            raise DataError(f"input of {T} positions is longer than the model's max_len ({self.config.max_len}); "
                            f"split it into windows of at most {self.config.max_len} tokens")
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
        cos, sin = self.rotary_embedding(x, position_ids)
        device_type = x.device.type
        rotary_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        rotary_emb = rotary_tables(cos, sin, rotary_dtype)
        attn_mask = None if paged_cache is not None else build_attention_mask(input_mask, T, input_ids.device)
        # Out of training, only the kept positions matter past the last block's attention, so
        # that block computes the rest for them alone; in training an MoE block's load-balancing
        # loss counts every position, so the positions are picked after it.
        keep = logits_index if not self.training else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, rotary_emb, attn_mask, paged_cache, keep if i == last else None)
        if logits_index is not None and (keep is None or not self.layers):
            x = select_positions(x, logits_index)
        x = self.norm(x)
        if not compute_logits:  # the caller applies lm_head itself, a few positions at a time
            out = {"hidden_states": x}
        elif target_ids is None:
            out = {"logits": self.lm_head(x), "hidden_states": x}
        elif isinstance(self.lm_head, Linear) and self.lm_head.bias is None:
            loss = linear_cross_entropy(x, self.lm_head.weight, target_ids, IGNORE_INDEX, label_smoothing)
            out = {"loss": loss, "hidden_states": x}
        else:  # a wrapped head (LoRA, tensor parallel): its own forward, then the plain loss
            logits = self.lm_head(x).flatten(0, 1).float()
            out = {"loss": F.cross_entropy(logits, target_ids.flatten(), ignore_index=IGNORE_INDEX,
                                           label_smoothing=label_smoothing), "hidden_states": x}
        aux = [layer.mlp.aux_loss for layer in self.layers
               if isinstance(layer.mlp, DeepSeekMoE) and layer.mlp.aux_loss is not None]
        if aux:
            out["aux_loss"] = torch.stack(aux).sum()
        return out

    def router_stats(self) -> dict[str, list[float]]:
        """Fraction of routed slots per expert in the last forward, per MoE layer."""
        return {f"layer{i}": layer.mlp.expert_load.tolist()
                for i, layer in enumerate(self.layers) if isinstance(layer.mlp, DeepSeekMoE)}
