"""Configuration dataclasses: ModelConfig (and TrainConfig, added by the trainer)."""

from astrai.config.model_config import PRESETS, ModelConfig, preset

__all__ = ["ModelConfig", "PRESETS", "preset"]
