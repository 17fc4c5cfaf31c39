"""What a run needs beyond a plain Trainer: a reward model built from a language model (rm),
LoRA adapters injected before the optimizer is built, and the stage-by-stage driver (kl).

The train command sends a config here only when ``needs_alignment_run`` says so; plain
pre-training, SFT, DPO and GRPO without adapters run a Trainer directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from astrai.alignment.kl_stages import train_kl_stages
from astrai.alignment.lora_callback import LoraSaveCallback
from astrai.errors import ConfigError
from astrai.model.lora import LoraConfig, inject_lora
from astrai.model.reward import RewardModel
from astrai.trainer.builder import load_model, refuse_quantized_weights
from astrai.trainer.trainer import Trainer


def needs_alignment_run(config) -> bool:
    """Whether ``config`` needs ``train``: a reward head (rm), adapters (LoRA) or several stages (kl)."""
    return config.train_type in ("rm", "kl") or bool(config.strategy_kwargs.get("lora"))


def prepare_model(config) -> Optional[Any]:
    """The model object a run needs when the plain loader is not enough (rm head, LoRA), else None."""
    lora = config.strategy_kwargs.get("lora")
    if config.train_type != "rm" and not lora:
        return None
    model = load_model(config)
    refuse_quantized_weights(model)  # before LoRA, which would find no float linear to adapt
    if config.train_type == "rm" and not isinstance(model, RewardModel):
        model = RewardModel.from_base(model)
    if lora:
        inject_lora(model, LoraConfig(**lora))
    return model


def train(config, resume: Optional[str] = None):
    """Run ``config`` with the alignment preparations; the final TrainContext (None for kl, which runs several)."""
    torch.manual_seed(config.random_seed)  # a reward head or adapters start the same in every run of the config
    model = prepare_model(config)
    callbacks = []
    if config.strategy_kwargs.get("lora"):
        callbacks.append(LoraSaveCallback(Path(config.ckpt_dir)))
        config.save_final_model = False
    if config.train_type == "kl":
        kwargs = dict(config.strategy_kwargs)
        stages = kwargs.get("stages")
        if not stages:
            raise ConfigError("train_type 'kl' needs stages: --stage_tokens N1,N2[,...] (and optionally --stage_datasets)")
        train_kl_stages(config, stages, beta=float(kwargs.get("beta", 0.1)), model=model, callbacks=callbacks,
                        resume=resume, estimate=kwargs.get("estimate", "exact"))
        return None
    return Trainer(config, callbacks=callbacks, model=model).train(resume)
