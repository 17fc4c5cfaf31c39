"""RewardModel: the Transformer with a scalar head, scoring a whole (prompt, response) text.

The score is read from the final hidden state of the last real token, the only
position that has seen the entire response. It registers as model type
``reward``, so ``AutoModel.from_pretrained`` opens a saved reward model like any other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from astrai.config import ModelConfig
from astrai.model.automodel import AutoModel
from astrai.model.components import Linear
from astrai.model.transformer import Transformer

REWARD_MODEL_TYPE = "reward"


def last_token_index(input_mask: Optional[torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token (mask 1), or of the last position without a mask."""
    B, T = input_ids.shape
    if input_mask is None:
        return torch.full((B,), T - 1, dtype=torch.long, device=input_ids.device)
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    return torch.where(input_mask.to(torch.bool), positions, torch.zeros_like(positions)).amax(dim=1)


@AutoModel.register(REWARD_MODEL_TYPE)
class RewardModel(Transformer):
    """Transformer + ``value_head`` (dim → 1); ``forward`` adds ``rewards`` [B] to the output dict."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.value_head = Linear(config.dim, 1)
        if self.value_head.weight.device.type != "meta":
            torch.nn.init.normal_(self.value_head.weight, std=config.init_std)

    @classmethod
    def from_base(cls, base: Transformer) -> "RewardModel":
        """A reward model initialised from a language model's weights (the head starts fresh)."""
        model = cls(replace(base.config, model_type=REWARD_MODEL_TYPE))
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        assert set(missing) == {"value_head.weight"} and not unexpected, (missing, unexpected)
        return model.to(next(base.parameters()).device)

    def forward(self, input_ids: torch.Tensor, input_mask: Optional[torch.Tensor] = None, paged_cache=None,
                position_ids: Optional[torch.Tensor] = None,
                logits_index: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """With a [B, T] padding mask the score comes from each row's last real token."""
        if logits_index is None and (input_mask is None or input_mask.dim() == 2):
            logits_index = last_token_index(input_mask, input_ids)
        out = super().forward(input_ids, input_mask, paged_cache, position_ids, logits_index)
        out["rewards"] = self.value_head(out["hidden_states"][:, -1]).squeeze(-1).float()
        return out

    def score(self, input_ids: torch.Tensor, input_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rewards [B] for right-padded sequences (mask 1 on real tokens)."""
        return self.forward(input_ids, input_mask)["rewards"]
