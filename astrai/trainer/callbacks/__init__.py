"""Training callbacks; each registers itself with CallbackFactory on import."""

from astrai.trainer.callbacks.base import CallbackFactory, TrainCallback
from astrai.trainer.callbacks.checkpointing import CheckpointCallback
from astrai.trainer.callbacks.gradients import GradientCheckpointingCallback, GradientClippingCallback
from astrai.trainer.callbacks.logging import MetricLoggerCallback, ProgressBarCallback, plot_metrics
from astrai.trainer.callbacks.save_model import SaveModelCallback
from astrai.trainer.callbacks.validation import ValidationCallback, evaluate

__all__ = ["CallbackFactory", "CheckpointCallback", "GradientCheckpointingCallback", "GradientClippingCallback",
           "MetricLoggerCallback", "ProgressBarCallback", "SaveModelCallback", "TrainCallback", "ValidationCallback", "evaluate",
           "plot_metrics"]
