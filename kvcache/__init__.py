"""A paged KV-cache manager: YAML config, block allocator, block tables, cache tensors.

The attention kernels that read the cache live in the sibling package :mod:`attention`.
"""

from kvcache.allocator import BlockAllocator
from kvcache.batch import MetadataBuilder, ScheduledRow, build_metadata
from kvcache.cache_tensors import KVCacheTensors, allocate_kv_cache, resolve_device
from kvcache.config import KVCacheConfig
from kvcache.errors import (
    CacheAllocationError,
    KVCacheError,
    OutOfBlocksError,
    SequenceExistsError,
    UnknownSequenceError,
)
from kvcache.loading import ConfigError, load_config, parse_config
from kvcache.manager import BlockManager, IntegrityError
from kvcache.metrics import CacheStats, PrometheusExporter, collect_stats
from kvcache.planning import CapacityPlan, plan_capacity
from kvcache.swap import SwapSpace

__all__ = [
    "BlockAllocator",
    "BlockManager",
    "CacheAllocationError",
    "CacheStats",
    "CapacityPlan",
    "ConfigError",
    "IntegrityError",
    "KVCacheConfig",
    "KVCacheError",
    "KVCacheTensors",
    "MetadataBuilder",
    "OutOfBlocksError",
    "PrometheusExporter",
    "ScheduledRow",
    "SequenceExistsError",
    "SwapSpace",
    "UnknownSequenceError",
    "allocate_kv_cache",
    "build_metadata",
    "collect_stats",
    "load_config",
    "parse_config",
    "plan_capacity",
    "resolve_device",
]
