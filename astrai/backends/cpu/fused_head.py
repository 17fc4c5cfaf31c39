"""A draft head's drafts in one call into C (``native/decode_step.c``'s ``astrai_draft_head_steps``).

Through the head's torch modules (astrai/model/draft_head.py) a draft token is a dozen
operator calls - four norms, a concatenation, five linears, SiLU, argmax, the id lookup -
each some tens of microseconds of Python and dispatch: at a head's size (a few million
weights) most of a draft's time, and a draft of four tokens a third of an int8 decode step
of SmolLM2. The C call drafts one row's ``k`` tokens in one parallel region, each step's
linears through the same one-row kernels as the fused decode step, so a draft costs the
reading of the head's weights. It takes a head whose linears the kernels read (fp32, bf16 or
int8/int4 blocks, no biases) and fp32 norms and embedding; ``for_head`` says None for any other.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from astrai.backends.cpu.kernels import HeadPlan, draft_head_steps, head_plan, kernels_available
from astrai.backends.cpu.serving import typed_weight


class FusedHead:
    """Drafts of one row by a draft head through ``astrai_draft_head_steps``."""

    def __init__(self, plan: HeadPlan):
        self.plan = plan

    @classmethod
    def for_head(cls, head: nn.Module) -> Optional["FusedHead"]:
        """The fused drafting of ``head`` (a DraftHead, laid out as the engine serves), or None when a
        weight is not of a type and layout the kernels read (or ``$ASTRAI_FUSED_DECODE`` is 0)."""
        if os.environ.get("ASTRAI_FUSED_DECODE", "1") == "0" or not kernels_available():
            return None
        modules = (head.fuse, head.gate_proj, head.up_proj, head.down_proj, head.out_proj)
        if any(getattr(m, "bias", None) is not None for m in modules):
            return None
        linears = [typed_weight(m) for m in modules]
        if None in linears:
            return None
        norms = [head.hidden_norm.weight, head.embed_norm.weight, head.mlp_norm.weight, head.out_norm.weight]
        try:
            plan = head_plan(head.target.embed_tokens.weight.detach(), [n.detach() for n in norms], linears,
                             head.draft_ids, float(head.config.norm_eps), max(torch.get_num_threads(), 1))
        except ValueError:
            return None
        return cls(plan)

    def __call__(self, hidden: torch.Tensor, token: int, k: int) -> list[int]:
        """``k`` greedy drafts after the target's final hidden state ``hidden`` [dim] and the token it chose."""
        self.plan.threads = max(torch.get_num_threads(), 1)  # the scratch memory does not depend on it
        return draft_head_steps(self.plan, hidden.detach().float().contiguous(), int(token), k)
