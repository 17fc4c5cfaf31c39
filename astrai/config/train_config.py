"""TrainConfig: every knob of a training run in one JSON-serialisable dataclass.

The CLI maps its flags onto these fields one to one, a checkpoint's meta.json stores
the whole thing, and ``validate()`` rejects impossible values before any work starts,
naming the field. Model- and data-dependent checks (window vs ``max_len``, tokenizer vs
vocabulary) happen in the trainer's context builder, which has both at hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from astrai.config.json_file import JsonConfig
from astrai.errors import ConfigError
from astrai.factory import registered_names

TRAIN_TYPES = ("seq", "sft", "dpo", "rm", "grpo", "kl")
SCHEDULES = ("cosine", "sgdr", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
PRECISIONS = ("auto", "fp32", "bf16")
PARALLEL_MODES = ("ddp", "fsdp")
DATASET_TYPES = ("seq", "sft", "dpo", "grpo")  # what a preprocessed directory holds (a mixture entry's "type")


@dataclass
class TrainConfig(JsonConfig):
    """A training run. Steps count optimizer steps (one per ``grad_accum_steps`` micro-batches)."""

    # what to train, on what
    train_type: str = "seq"
    data_root_path: Optional[str] = None
    datasets: Optional[list] = None            # mixture: [{"path": ..., "rate": 0.7, "type": "seq"}, ...]
    dataset_type: Optional[str] = None         # DatasetFactory type if it differs from train_type
    val_data_path: Optional[str] = None
    val_fraction: float = 0.0                  # hold out this share of the training data when no val_data_path
    param_path: Optional[str] = None           # model directory (config.json [+ weights])
    model_preset: Optional[str] = None         # or build a fresh model from a preset ...
    model_overrides: dict = field(default_factory=dict)  # ... with these ModelConfig fields changed
    tokenizer_path: Optional[str] = None       # defaults to param_path when it holds tokenizer.json
    # batch and budget
    batch_per_device: int = 4
    grad_accum_steps: int = 1
    window_size: int = 512
    stride: Optional[int] = None
    n_epoch: int = 1
    total_tokens: Optional[int] = None         # token budget; overrides n_epoch
    max_steps: Optional[int] = None
    # optimisation
    optimizer: str = "adamw"
    max_lr: float = 3e-4
    muon_lr: float = 0.02
    embedding_lr_scale: float = 1.0            # token embedding (and a head tied to it) at max_lr × this
    embedding_weight_decay: float = 0.0        # decoupled weight decay of that table (none by default)
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.95
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    label_smoothing: float = 0.0
    schedule: str = "cosine"
    warmup_ratio: float = 0.05
    decay_ratio: float = 0.2                   # WSD: final share of steps spent decaying
    min_rate: float = 0.1
    sgdr_cycle_ratio: float = 0.25             # SGDR: first cycle as a share of the post-warmup steps
    sgdr_t_mult: int = 2
    strategy_kwargs: dict = field(default_factory=dict)
    # checkpoints, logs, validation
    ckpt_dir: str = "./checkpoint"
    ckpt_interval: int = 1000
    ckpt_keep: int = 3
    log_dir: Optional[str] = None              # defaults to ckpt_dir
    log_interval: int = 1
    validation_interval: int = 0               # 0 = only at the end (when a validation set exists)
    validation_batches: int = 8
    progress_bar: bool = True
    save_final_model: bool = True              # write <ckpt_dir>/final as a model directory at the end
    # execution
    random_seed: int = 3407
    device: str = "auto"
    precision: str = "auto"
    compile: bool = False
    gradient_checkpointing: bool = False
    gradient_checkpointing_modules: list = field(default_factory=lambda: ["DecoderBlock"])
    num_workers: int = 0
    pin_memory: bool = True                    # page-locked batches when training on a GPU (ignored on CPU)
    nprocs: int = 1
    parallel_mode: str = "ddp"
    backend: str = "auto"
    master_addr: str = "127.0.0.1"
    master_port: int = 0                       # --nprocs rendezvous port; 0 = any free one

    def validate(self, require_data: bool = True, require_model: bool = True) -> "TrainConfig":
        """Raise ConfigError naming the first bad field; return self when all is well.

        ``require_data``/``require_model`` are False when the caller hands the trainer a
        dataset or model object instead of a path.
        """

        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"TrainConfig.{name}: {msg} (got {getattr(self, name)!r})")

        # a strategy the user registered (StrategyFactory.register) is valid too
        need(self.train_type in TRAIN_TYPES or self.train_type in registered_names("train_type"), "train_type",
             f"choose one of {', '.join(TRAIN_TYPES)} or a registered strategy's name")
        need(self.optimizer in OPTIMIZERS, "optimizer", f"choose one of {', '.join(OPTIMIZERS)}")
        need(self.schedule in SCHEDULES, "schedule", f"choose one of {', '.join(SCHEDULES)}")
        need(self.precision in PRECISIONS, "precision", f"choose one of {', '.join(PRECISIONS)}")
        need(self.parallel_mode in PARALLEL_MODES, "parallel_mode", f"choose one of {', '.join(PARALLEL_MODES)}")
        for name in ("batch_per_device", "grad_accum_steps", "window_size", "n_epoch", "ckpt_interval", "ckpt_keep",
                     "log_interval", "nprocs", "validation_batches", "sgdr_t_mult"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, "must be a positive integer")
        for name in ("total_tokens", "max_steps", "stride"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, int) and value > 0), name, "must be a positive integer or null")
        for name in ("max_lr", "muon_lr", "adamw_eps", "embedding_lr_scale"):
            need(isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0, name, "must be > 0")
        need(self.adamw_weight_decay >= 0, "adamw_weight_decay", "must be >= 0")
        need(self.embedding_weight_decay >= 0, "embedding_weight_decay", "must be >= 0")
        need(isinstance(self.master_port, int) and 0 <= self.master_port <= 65535, "master_port",
             "must be a port number 0-65535 (0: any free one)")
        need(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 disables clipping)")
        for name in ("adamw_beta1", "adamw_beta2"):
            need(0 <= getattr(self, name) < 1, name, "must be in [0, 1)")
        for name in ("warmup_ratio", "decay_ratio", "min_rate", "val_fraction"):
            need(0 <= getattr(self, name) <= 1, name, "must be in [0, 1]")
        need(0 < self.sgdr_cycle_ratio <= 1, "sgdr_cycle_ratio", "must be in (0, 1]")
        need(self.warmup_ratio + (self.decay_ratio if self.schedule == "wsd" else 0) <= 1, "warmup_ratio",
             "warmup_ratio + decay_ratio must not exceed 1")
        need(0 <= self.label_smoothing < 1, "label_smoothing", "must be in [0, 1)")
        need(self.validation_interval >= 0, "validation_interval", "must be >= 0")
        need(self.num_workers >= 0, "num_workers", "must be >= 0")
        need(not require_data or self.data_root_path is not None or self.datasets, "data_root_path",
             "give a training data path (or a 'datasets' mixture)")
        if self.data_root_path is not None:
            need(Path(self.data_root_path).exists(), "data_root_path", "path does not exist")
        need(self.dataset_type in (None, *DATASET_TYPES), "dataset_type",
             f"unknown dataset type {self.dataset_type!r}; choose one of {', '.join(DATASET_TYPES)}")
        if self.datasets:
            need(isinstance(self.datasets, list), "datasets", "must be a list of {path, rate}")
            for i, entry in enumerate(self.datasets):
                ok = isinstance(entry, dict) and "path" in entry and float(entry.get("rate", 1.0)) > 0
                need(ok, "datasets", f"entry {i} must be an object with 'path' and a positive 'rate'")
                need(Path(entry["path"]).exists(), "datasets", f"entry {i}: path {entry['path']!r} does not exist")
                need(entry.get("type") in (None, *DATASET_TYPES), "datasets",
                     f"entry {i}: unknown type {entry.get('type')!r}; choose one of {', '.join(DATASET_TYPES)}")
        if self.val_data_path is not None:
            need(Path(self.val_data_path).exists(), "val_data_path", "path does not exist")
        need(not require_model or self.param_path is not None or self.model_preset is not None, "param_path",
             "give a model directory (param_path) or a model_preset")
        if self.param_path is not None:
            need((Path(self.param_path) / "config.json").is_file(), "param_path", "no config.json in that directory")
        if self.tokenizer_path is not None:
            need((Path(self.tokenizer_path) / "tokenizer.json").is_file(), "tokenizer_path", "no tokenizer.json there")
        return self
