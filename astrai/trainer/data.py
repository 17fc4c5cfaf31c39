"""Training data: the dataset(s) named by a TrainConfig, a held-out split, and loaders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from astrai.errors import DataError
from astrai.trainer.sampling import MixtureSampler

DATASET_TYPE_OF = {"rm": "dpo", "kl": "seq"}


@dataclass
class TrainData:
    train_sources: list[Dataset]
    rates: list[float]
    val: Optional[Dataset]

    @property
    def train(self) -> Dataset:
        return self.train_sources[0] if len(self.train_sources) == 1 else ConcatDataset(self.train_sources)


def dataset_type(config) -> str:
    return config.dataset_type or DATASET_TYPE_OF.get(config.train_type, config.train_type)


def load_dataset(config, path: str) -> Dataset:
    from astrai.dataset import DatasetFactory

    dataset = DatasetFactory.load(dataset_type(config), path, config.window_size, config.stride)
    if len(dataset) == 0:
        raise DataError(f"{path}: no training samples of window {config.window_size} (data too small?)")
    return dataset


def resolve_data(config, train: Optional[Dataset] = None, val: Optional[Dataset] = None) -> TrainData:
    """Datasets from the config (or the given objects), with a held-out tail when ``val_fraction`` > 0."""
    if train is not None:
        sources, rates = [train], [1.0]
    elif config.datasets:
        sources = [load_dataset(config, entry["path"]) for entry in config.datasets]
        rates = [float(entry.get("rate", 1.0)) for entry in config.datasets]
    else:
        sources, rates = [load_dataset(config, config.data_root_path)], [1.0]
    if val is None and config.val_data_path:
        val = load_dataset(config, config.val_data_path)
    if val is None and config.val_fraction > 0:
        first = sources[0]
        n_val = max(1, int(len(first) * config.val_fraction))
        if n_val >= len(first):
            raise DataError(f"val_fraction {config.val_fraction} leaves no training samples ({len(first)} in total)")
        val = Subset(first, range(len(first) - n_val, len(first)))
        sources[0] = Subset(first, range(len(first) - n_val))
    return TrainData(sources, rates, val)


def pins_batches(config) -> bool:
    """Batches go to page-locked memory when they are bound for a GPU: only from there is the
    strategy's ``non_blocking`` copy asynchronous (from pageable memory it waits for the GPU)."""
    return bool(config.pin_memory) and config.device != "cpu" and torch.cuda.is_available()


def make_loader(dataset: Dataset, sampler, config, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=config.num_workers,
                      pin_memory=pins_batches(config), drop_last=True, persistent_workers=False)


def make_train_loader(data: TrainData, config, rank: int, world_size: int) -> tuple[DataLoader, MixtureSampler]:
    sampler = MixtureSampler([len(s) for s in data.train_sources], data.rates, config.random_seed, True, rank, world_size)
    if len(sampler) < config.batch_per_device:
        raise DataError(f"only {len(sampler)} training samples per rank, fewer than batch_per_device "
                        f"({config.batch_per_device}); use more data or a smaller batch/window")
    return make_loader(data.train, sampler, config, config.batch_per_device), sampler
