"""Configuration dataclasses: ModelConfig and TrainConfig."""

from astrai.config.model_config import PRESETS, ModelConfig, preset
from astrai.config.train_config import TrainConfig

__all__ = ["ModelConfig", "PRESETS", "TrainConfig", "preset"]
