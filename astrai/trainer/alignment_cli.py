"""What the alignment and LoRA flags of ``astrai train`` (astrai/commands/train.py) change about a run.

Strategy settings (``--beta``, ``--group_size``, ``--reward``, ``--stage_tokens``, ...)
are folded into ``TrainConfig.strategy_kwargs`` so they are saved in every checkpoint's
meta.json and a resumed run gets them back; LoRA settings go there too, under ``lora``.
``train`` then prepares what a plain Trainer run cannot: a reward model built from a
language model (rm), adapters injected before the optimizer is built (LoRA), and the
stage-by-stage driver (kl).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from astrai.commands.train import STRATEGY_FLAGS
from astrai.errors import ConfigError


def alignment_strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy_kwargs entries given by flags (only the flags actually passed)."""
    given = vars(args)
    kwargs = {name: given[name] for name in STRATEGY_FLAGS if name in given}
    if "stage_tokens" in given or "stage_datasets" in given:
        tokens = given.get("stage_tokens")
        mixtures = given.get("stage_datasets")
        if tokens is None:
            raise ConfigError("--stage_datasets needs --stage_tokens (one budget per stage)")
        if mixtures is not None and len(mixtures) != len(tokens):
            raise ConfigError(f"--stage_datasets has {len(mixtures)} mixtures for {len(tokens)} stages")
        kwargs["stages"] = [{"tokens": t, **({"datasets": mixtures[i]} if mixtures else {})} for i, t in enumerate(tokens)]
    if "lora_rank" in given:
        rank = given["lora_rank"]
        kwargs["lora"] = {"rank": rank, "alpha": given.get("lora_alpha", 2.0 * rank)}
        if "lora_targets" in given:
            kwargs["lora"]["targets"] = given["lora_targets"]
    elif "lora_alpha" in given or "lora_targets" in given:
        raise ConfigError("--lora_alpha/--lora_targets need --lora_rank")
    return kwargs


def prepare_model(config) -> Optional[Any]:
    """The model object a run needs when the plain loader is not enough (rm head, LoRA), else None."""
    lora = config.strategy_kwargs.get("lora")
    if config.train_type != "rm" and not lora:
        return None
    from astrai.model.lora import LoraConfig, inject_lora
    from astrai.model.reward import RewardModel
    from astrai.trainer.builder import load_model, refuse_quantized_weights

    model = load_model(config)
    refuse_quantized_weights(model)  # before LoRA, which would find no float linear to adapt
    if config.train_type == "rm" and not isinstance(model, RewardModel):
        model = RewardModel.from_base(model)
    if lora:
        inject_lora(model, LoraConfig(**lora))
    return model


def train(config, resume: Optional[str] = None):
    """Run ``config`` with the alignment preparations; the final TrainContext (None for kl, which runs several)."""
    import torch

    from astrai.trainer.trainer import Trainer

    torch.manual_seed(config.random_seed)  # a reward head or adapters start the same in every run of the config
    model = prepare_model(config)
    callbacks = []
    if config.strategy_kwargs.get("lora"):
        from astrai.trainer.lora_callback import LoraSaveCallback

        callbacks.append(LoraSaveCallback(Path(config.ckpt_dir)))
        config.save_final_model = False
    if config.train_type == "kl":
        from astrai.trainer.kl_stages import train_kl_stages

        kwargs = dict(config.strategy_kwargs)
        stages = kwargs.get("stages")
        if not stages:
            raise ConfigError("train_type 'kl' needs stages: --stage_tokens N1,N2[,...] (and optionally --stage_datasets)")
        train_kl_stages(config, stages, beta=float(kwargs.get("beta", 0.1)), model=model, callbacks=callbacks,
                        resume=resume, estimate=kwargs.get("estimate", "exact"))
        return None
    return Trainer(config, callbacks=callbacks, model=model).train(resume)
