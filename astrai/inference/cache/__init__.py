"""Paged KV cache: storage in fixed-size pages, reference-counted allocation, and
prefix sharing of full pages between requests."""

from astrai.inference.cache.allocator import Allocator
from astrai.inference.cache.kvcache import KVCache, KvcacheView
from astrai.inference.cache.page_pool import PagePool
from astrai.inference.cache.prefix_cache import PrefixCache
from astrai.inference.cache.storage import Storage
from astrai.inference.cache.task_table import TaskTable

__all__ = ["Allocator", "KVCache", "KvcacheView", "PagePool", "PrefixCache", "Storage", "TaskTable"]
