"""Inference: paged KV cache, continuous-batching scheduler, sampling and the engine.

The HTTP server (``astrai.serving``) builds on these names and is not
imported here, so using the engine never pulls in web dependencies.
"""

from astrai.inference.cache import Allocator, KVCache, KvcacheView, PagePool, PrefixCache, Storage, TaskTable
from astrai.inference.draft_model import DraftModel
from astrai.inference.engine import InferenceEngine
from astrai.inference.executor import Executor
from astrai.inference.handle import RequestHandle
from astrai.inference.head_drafter import HeadDrafter
from astrai.inference.result import GenerateResult
from astrai.inference.sampling import (BaseSamplingStrategy, MinPStrategy, SamplingPipeline, TemperatureStrategy,
                                       TopKStrategy, TopPStrategy, sample)
from astrai.inference.scheduler import InferenceScheduler
from astrai.inference.speculative import PromptLookup
from astrai.inference.stop import StopChecker
from astrai.inference.task import Task, TaskManager, TaskStatus
from astrai.inference.types import GenerationRequest, SamplingParams, StreamEvent, TokenLogprob

__all__ = [
    "Allocator", "BaseSamplingStrategy", "DraftModel", "Executor", "GenerateResult", "GenerationRequest", "HeadDrafter",
    "InferenceEngine", "InferenceScheduler", "KVCache", "KvcacheView", "MinPStrategy", "PagePool", "PrefixCache",
    "PromptLookup", "RequestHandle",
    "SamplingParams", "SamplingPipeline", "Storage", "StopChecker", "StreamEvent", "Task", "TaskManager", "TaskStatus",
    "TaskTable", "TemperatureStrategy", "TokenLogprob", "TopKStrategy", "TopPStrategy", "sample",
]
