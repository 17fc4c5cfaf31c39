"""astrai.trainer: strategies, schedules, callbacks and the training loop."""

from astrai.trainer.strategies import BaseStrategy, StrategyFactory

__all__ = ["BaseStrategy", "StrategyFactory"]
