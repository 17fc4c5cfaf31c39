"""Training strategies, registered with StrategyFactory by importing their modules.

To add one: write ``astrai/trainer/strategies/<name>.py`` with a BaseStrategy subclass
decorated ``@StrategyFactory.register("<name>")`` and add its import line below.
"""

from astrai.trainer.strategies.base import IGNORE_INDEX, BaseStrategy, StrategyFactory
from astrai.trainer.strategies.masks import document_mask, model_inputs
from astrai.trainer.strategies.seq import SEQStrategy, SFTStrategy, token_cross_entropy
from astrai.trainer.strategies.dpo import DPOStrategy
from astrai.trainer.strategies.rm import RMStrategy
from astrai.trainer.strategies.grpo import GRPOStrategy
from astrai.trainer.strategies.kl import KLStrategy

__all__ = ["DPOStrategy", "GRPOStrategy", "IGNORE_INDEX", "KLStrategy", "RMStrategy", "BaseStrategy", "SEQStrategy", "SFTStrategy", "StrategyFactory", "document_mask",
           "model_inputs", "token_cross_entropy"]
