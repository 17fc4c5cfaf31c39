"""Training data: the dataset(s) named by a TrainConfig, a held-out split, and loaders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from astrai.dataset import DatasetFactory
from astrai.dataset.datasets import IGNORE_INDEX
from astrai.errors import DataError
from astrai.trainer.mixture import MixtureSampler

DATASET_TYPE_OF = {"rm": "dpo", "kl": "seq", "draft_head": "sft"}


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


def load_dataset(config, path: str, kind: Optional[str] = None) -> Dataset:
    """The preprocessed directory ``path`` as a dataset of type ``kind`` (default: the run's)."""
    dataset = DatasetFactory.load(kind or dataset_type(config), path, config.window_size, config.stride)
    if len(dataset) == 0:
        raise DataError(f"{path}: no training samples of window {config.window_size} (data too small?)")
    return dataset


class EveryTokenCounts(Dataset):
    """Pre-training windows served to an SFT run: ``loss_mask`` 1 wherever the target counts.

    Mixing some pre-training text into fine-tuning (replay) keeps the model's plain-text
    skill that SFT on a small conversation set otherwise wears away; in the quick start
    one SFT stage took held-out English perplexity from 32 to 180."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = dict(self.dataset[index])
        item["loss_mask"] = (item["target_ids"] != IGNORE_INDEX).long()
        return item


def mixture_source(config, index: int, entry: dict) -> Dataset:
    """One entry of a ``datasets`` mixture; an entry's own ``type`` may differ from the run's
    only where the batches still fit its strategy: pre-training text in an SFT run."""
    run_kind = dataset_type(config)
    kind = entry.get("type") or run_kind
    dataset = load_dataset(config, entry["path"], kind)
    if kind == run_kind:
        return dataset
    if (kind, run_kind) == ("seq", "sft"):
        return EveryTokenCounts(dataset)
    raise DataError(f"datasets entry {index} ({entry['path']}): a '{kind}' source cannot feed a '{run_kind}' run; "
                    f"only pre-training ('seq') text mixes into 'sft' runs")


def check_same_keys(sources: list[Dataset], paths: list[str]) -> None:
    """Batches of a mixture are stacked from several sources: each must give the same fields."""
    first = set(sources[0][0])
    for source, path in zip(sources[1:], paths[1:]):
        keys = set(source[0])
        if keys != first:
            raise DataError(f"datasets mixture: {path} gives {sorted(keys)} but {paths[0]} gives {sorted(first)}; "
                            f"preprocess them with the same packing options (doc mask, position ids)")


def resolve_data(config, train: Optional[Dataset] = None, val: Optional[Dataset] = None) -> TrainData:
    """Datasets from the config (or the given objects), with a held-out tail when ``val_fraction`` > 0."""
    if train is not None:
        sources, rates = [train], [1.0]
    elif config.datasets:
        sources = [mixture_source(config, i, entry) for i, entry in enumerate(config.datasets)]
        rates = [float(entry.get("rate", 1.0)) for entry in config.datasets]
        check_same_keys(sources, [entry["path"] for entry in config.datasets])
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
