"""Inference: paged KV cache, continuous-batching scheduler, sampling and the engine.

The HTTP server (``astrai.serving``) builds on these names and is not
imported here, so using the engine never pulls in web dependencies.
"""

from astrai.inference.cache import Allocator, KVCache, KvcacheView, PagePool, PrefixCache, Storage, TaskTable
from astrai.inference.engine import InferenceEngine
from astrai.inference.executor import Executor
from astrai.inference.handle import RequestHandle
from astrai.inference.result import GenerateResult
from astrai.inference.sampling import (BaseSamplingStrategy, MinPStrategy, SamplingPipeline, TemperatureStrategy,
                                       TopKStrategy, TopPStrategy, sample)
from astrai.inference.scheduler import InferenceScheduler
from astrai.inference.stop import StopChecker
from astrai.inference.task import Task, TaskManager, TaskStatus
from astrai.inference.types import GenerationRequest, SamplingParams, StreamEvent, TokenLogprob

__all__ = [
    "Allocator", "BaseSamplingStrategy", "Executor", "GenerateResult", "GenerationRequest", "InferenceEngine",
    "InferenceScheduler", "KVCache", "KvcacheView", "MinPStrategy", "PagePool", "PrefixCache", "RequestHandle",
    "SamplingParams", "SamplingPipeline", "Storage", "StopChecker", "StreamEvent", "Task", "TaskManager", "TaskStatus",
    "TaskTable", "TemperatureStrategy", "TokenLogprob", "TopKStrategy", "TopPStrategy", "sample",
]
