"""TrainContextBuilder: config (+ optional objects, + optional checkpoint) → a ready TrainContext.

All checks that need the model, tokenizer or data happen here, before any step runs,
so a bad run fails in seconds with the field named.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from astrai.config import ModelConfig, TrainConfig, preset
from astrai.errors import ConfigError, DataError
from astrai.model import AutoModel, DecoderBlock
from astrai.model.quantized import QuantizedLinear
from astrai.parallel import get_current_device, get_rank, get_world_size, wrap_model
from astrai.parallel.wrap import load_full_model_state
from astrai.serialization import Checkpoint
from astrai.tokenize import AutoTokenizer
from astrai.trainer.context import TrainContext
from astrai.trainer.data import make_loader, make_train_loader, resolve_data
from astrai.trainer.lr_schedules import SchedulerFactory, scheduler_kwargs
from astrai.trainer.mixture import MixtureSampler
from astrai.trainer.optimizers import build_optimizer
from astrai.trainer.state import restore_training_state, seed_rng
from astrai.trainer.strategies import StrategyFactory


def resolve_device(config: TrainConfig) -> torch.device:
    if config.device == "auto":
        return get_current_device()
    try:
        return torch.device(config.device)
    except RuntimeError:
        raise ConfigError(f"TrainConfig.device: {config.device!r} is not a device (auto, cpu, cuda, cuda:1, ...)") from None


def resolve_autocast(config: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """bf16 autocast when asked, or by default on GPUs that support it; fp32 master weights either way."""
    if config.precision == "bf16":
        return torch.bfloat16
    if config.precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return None


def load_model(config: TrainConfig) -> nn.Module:
    if config.param_path is not None:
        root = Path(config.param_path)
        has_weights = (root / "model.safetensors").is_file() or (root / "model.safetensors.index.json").is_file()
        if has_weights:
            return AutoModel.from_pretrained(root)
        model_config = ModelConfig.load(root / "config.json")
        for key, value in config.model_overrides.items():
            setattr(model_config, key, value)
        return AutoModel.from_config(model_config)
    return AutoModel.from_config(preset(config.model_preset, **config.model_overrides))


def load_tokenizer(config: TrainConfig) -> Any:
    path = config.tokenizer_path
    if path is None and config.param_path and (Path(config.param_path) / "tokenizer.json").is_file():
        path = config.param_path
    if path is None:
        return None
    return AutoTokenizer.from_pretrained(path)


def refuse_quantized_weights(model: nn.Module) -> None:
    """ConfigError for a model holding int8/int4 blocks (``astrai model quantize``, an imported
    GGUF): packed blocks take no gradient, and int4's rounding of the activations passes none
    back to earlier layers, so neither full training nor LoRA over such a base would learn what
    it reports; refused before any step instead of failing at the end."""
    quantized = [name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    if quantized:
        formats = sorted({f"int{m.bits}" for m in model.modules() if isinstance(m, QuantizedLinear)})
        raise ConfigError(f"the model holds {len(quantized)} quantized linear layers ({'/'.join(formats)}, e.g. "
                          f"{quantized[0]}); astrai trains float weights only (LoRA too): train the float model "
                          "it was quantized from, or a copy turned back to floats with "
                          "astrai.model.quantized.dequantize_model, and quantize the result afterwards")


def check_model_fits(config: TrainConfig, model: nn.Module, tokenizer: Any) -> None:
    model_config = getattr(model, "config", None)
    if model_config is None:
        return
    if config.window_size > model_config.max_len:
        raise ConfigError(f"TrainConfig.window_size: {config.window_size} is larger than the model's max_len "
                          f"({model_config.max_len})")
    if tokenizer is not None and tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(f"vocab_size: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size "
                          f"is {model_config.vocab_size}; build the model with vocab_size >= {tokenizer.vocab_size}")


def strategy_kwargs(config: TrainConfig, tokenizer: Any, extra: dict) -> dict:
    """config.strategy_kwargs + objects given to the builder (``strategy_extra``), plus
    ``label_smoothing``, ``tokenizer`` and ``train_config`` for strategies whose
    ``__init__`` names those parameters."""
    cls = StrategyFactory.get(config.train_type)
    kwargs = dict(config.strategy_kwargs)
    kwargs.update(extra)
    accepted = inspect.signature(cls.__init__).parameters
    offered = {"label_smoothing": config.label_smoothing, "tokenizer": tokenizer, "train_config": config}
    for name, value in offered.items():
        if name in accepted:
            kwargs.setdefault(name, value)
    return kwargs


class TrainContextBuilder:
    """``TrainContextBuilder(config).with_checkpoint(ckpt).build()``; objects given here
    (model, datasets, tokenizer) take the place of the paths in the config."""

    def __init__(self, config: TrainConfig, model: Optional[nn.Module] = None, train_dataset: Optional[Dataset] = None,
                 val_dataset: Optional[Dataset] = None, tokenizer: Any = None, strategy_extra: Optional[dict] = None):
        self.config = config
        self.model, self.train_dataset, self.val_dataset, self.tokenizer = model, train_dataset, val_dataset, tokenizer
        self.strategy_extra = dict(strategy_extra or {})
        self.checkpoint: Optional[Checkpoint] = None

    def with_checkpoint(self, checkpoint: Optional[Checkpoint | str | Path]) -> "TrainContextBuilder":
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            checkpoint = Checkpoint.load(checkpoint)
        self.checkpoint = checkpoint
        return self

    def validate(self) -> None:
        self.config.validate(require_data=self.train_dataset is None, require_model=self.model is None)
        if self.config.train_type not in StrategyFactory.list_registered():
            raise ConfigError(f"TrainConfig.train_type: no strategy '{self.config.train_type}' is registered; "
                              f"known: {', '.join(StrategyFactory.list_registered())} (dpo, rm, grpo and kl "
                              f"register when astrai.alignment is imported)")

    def build(self) -> TrainContext:
        config = self.config
        self.validate()
        rank, world = get_rank(), get_world_size()
        device = resolve_device(config)
        seed_rng(config.random_seed)
        model = self.model if self.model is not None else load_model(config)
        tokenizer = self.tokenizer if self.tokenizer is not None else load_tokenizer(config)
        check_model_fits(config, model, tokenizer)
        data = resolve_data(config, self.train_dataset, self.val_dataset)
        model = StrategyFactory.get(config.train_type).module_to_train(model, data.train, config)
        refuse_quantized_weights(model)
        if self.checkpoint is not None:
            load_full_model_state(model, self.checkpoint.state_dict)
        model.to(device)
        model.train()
        if config.compile:
            model = torch.compile(model)
        model = wrap_model(model, config.parallel_mode, device, shard_modules=(DecoderBlock,))
        optimizer = build_optimizer(model, config)
        loader, sampler = make_train_loader(data, config, rank, world)
        steps_per_epoch = len(loader) // config.grad_accum_steps
        if steps_per_epoch == 0:
            raise DataError(f"an epoch has {len(loader)} batches per rank, fewer than grad_accum_steps "
                            f"({config.grad_accum_steps}); use more data or smaller batches")
        tokens_per_step = config.batch_per_device * config.window_size * config.grad_accum_steps * world
        total_steps = total_steps_for(config, steps_per_epoch, tokens_per_step)
        scheduler = SchedulerFactory.create(optimizer, config.schedule, **scheduler_kwargs(config, total_steps))
        val_loader = None
        if data.val is not None:
            val_sampler = MixtureSampler([len(data.val)], shuffle=False, rank=rank, world_size=world)
            val_loader = make_loader(data.val, val_sampler, config, min(config.batch_per_device, len(val_sampler)))
        strategy = StrategyFactory.create(model, config.train_type, device,
                                          **strategy_kwargs(config, tokenizer, self.strategy_extra))
        context = TrainContext(config=config, model=model, strategy=strategy, optimizer=optimizer, scheduler=scheduler,
                               dataloader=loader, sampler=sampler, device=device, total_steps=total_steps,
                               steps_per_epoch=steps_per_epoch, tokens_per_step=tokens_per_step,
                               log_dir=Path(config.log_dir or config.ckpt_dir), val_loader=val_loader,
                               checkpoint=self.checkpoint, autocast_dtype=resolve_autocast(config, device),
                               tokenizer=tokenizer, rank=rank, world_size=world)
        if self.checkpoint is not None:
            restore_training_state(context, self.checkpoint)
        return context


def total_steps_for(config: TrainConfig, steps_per_epoch: int, tokens_per_step: int) -> int:
    """Optimizer steps of the run: max_steps, else the token budget, else n_epoch epochs."""
    if config.max_steps:
        return config.max_steps
    if config.total_tokens:
        return max(1, math.ceil(config.total_tokens / tokens_per_step))
    return config.n_epoch * steps_per_epoch
