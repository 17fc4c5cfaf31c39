"""Alignment on top of the generic training loop: DPO, the reward model, GRPO (rollouts
through the inference engine, rewards), KL-staged runs and LoRA adapters.

Importing this package registers the train types ``dpo``, ``rm``, ``grpo`` and ``kl`` with
the trainer's StrategyFactory; the trainer itself never imports it. ``train`` runs a config
that needs more than a plain Trainer (a reward head, LoRA adapters, the stage driver).
"""

from astrai.alignment.dpo import DPOStrategy
from astrai.alignment.grpo import GRPOStrategy
from astrai.alignment.kl import KLStrategy
from astrai.alignment.reward_model import RMStrategy
from astrai.alignment.run import needs_alignment_run, train

__all__ = ["DPOStrategy", "GRPOStrategy", "KLStrategy", "RMStrategy", "needs_alignment_run", "train"]
