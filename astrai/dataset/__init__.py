"""astrai.dataset: storage formats, preprocessing, datasets and the resumable sampler."""

from astrai.dataset.datasets import (BaseDataset, DatasetFactory, DPODataset, GRPODataset, SEQDataset, SFTDataset,
                                     positions_from_doc_ids)
from astrai.dataset.fetcher import BaseSegmentFetcher, MultiSegmentFetcher
from astrai.dataset.formats import H5Storage, JSONStorage, MmapStorage, load_h5, load_json, save_h5, save_json
from astrai.dataset.preprocess import PreprocessOptions, run_preprocess
from astrai.dataset.sampler import ResumableDistributedSampler
from astrai.dataset.storage_formats import BaseStorage, create_storage, detect_format

__all__ = [
    "BaseDataset", "BaseSegmentFetcher", "BaseStorage", "DPODataset", "DatasetFactory", "GRPODataset", "H5Storage",
    "JSONStorage", "MmapStorage", "MultiSegmentFetcher", "PreprocessOptions", "ResumableDistributedSampler",
    "SEQDataset", "SFTDataset", "create_storage", "detect_format", "load_h5", "load_json", "positions_from_doc_ids",
    "run_preprocess", "save_h5", "save_json",
]
