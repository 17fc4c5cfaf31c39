"""astrai.trainer: the generic training loop (Trainer, its context and builder), the seq/sft
strategies, learning-rate schedules, optimizers and callbacks. Alignment (DPO, reward model,
GRPO, KL stages, LoRA) builds on it in astrai/alignment, which this package never imports."""

from astrai.trainer.builder import TrainContextBuilder
from astrai.trainer.callbacks import (CallbackFactory, CheckpointCallback, GradientCheckpointingCallback,
                                      GradientClippingCallback, MetricLoggerCallback, ProgressBarCallback, TrainCallback,
                                      ValidationCallback)
from astrai.trainer.context import TrainContext
from astrai.trainer.lr_schedules import (BaseScheduler, CosineScheduler, SchedulerFactory, SGDRScheduler,
                                         WSDScheduler)
from astrai.trainer.strategies import BaseStrategy, SEQStrategy, SFTStrategy, StrategyFactory
from astrai.trainer.trainer import Trainer

__all__ = ["BaseScheduler", "BaseStrategy", "CallbackFactory", "CheckpointCallback", "CosineScheduler",
           "GradientCheckpointingCallback", "GradientClippingCallback", "MetricLoggerCallback", "ProgressBarCallback",
           "SEQStrategy", "SFTStrategy", "SGDRScheduler", "SchedulerFactory", "StrategyFactory", "TrainCallback",
           "TrainContext", "TrainContextBuilder", "Trainer", "ValidationCallback", "WSDScheduler"]
