"""Training strategies, registered with StrategyFactory by importing their modules.

To add one: write ``astrai/trainer/strategies/<name>.py`` with a BaseStrategy subclass
decorated ``@StrategyFactory.register("<name>")`` and add its import line below. The
alignment strategies (dpo, rm, grpo, kl) live in astrai/alignment and register when that
package is imported.
"""

from astrai.trainer.strategies.base import IGNORE_INDEX, BaseStrategy, StrategyFactory
from astrai.trainer.strategies.masks import document_mask, model_inputs
from astrai.trainer.strategies.seq import SEQStrategy, SFTStrategy, token_cross_entropy
from astrai.trainer.strategies.draft_head import DraftHeadStrategy

__all__ = ["IGNORE_INDEX", "BaseStrategy", "DraftHeadStrategy", "SEQStrategy", "SFTStrategy", "StrategyFactory", "document_mask",
           "model_inputs", "token_cross_entropy"]
