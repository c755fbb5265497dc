"""A paged KV-cache manager: YAML config, block allocator, block tables, cache tensors.

The attention kernels that read the cache live in the sibling package :mod:`attention`.
Names are imported lazily, so ``kvcache validate`` and other config-only uses never import
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attention.errors import (
        ArgumentTypeError,
        BackendUnavailableError,
        CacheAllocationError,
        ConfigError,
        IntegrityError,
        InvalidArgumentError,
        KVCacheError,
        MetadataError,
        OutOfBlocksError,
        SequenceExistsError,
        UnknownSequenceError,
        UnsupportedSettingError,
    )
    from attention.staging import StepCapacity
    from kvcache.allocator import BlockAllocator
    from kvcache.builder import MetadataBuilder, build_metadata
    from kvcache.cache_tensors import KVCacheTensors, allocate_kv_cache, resolve_device
    from kvcache.config import KVCacheConfig
    from kvcache.loading import load_config, parse_config
    from kvcache.manager import BlockManager
    from kvcache.metrics import CacheStats, PrometheusExporter, collect_stats
    from kvcache.planning import CapacityPlan, plan_capacity
    from kvcache.preemption import preempt
    from kvcache.rows import ScheduledRow
    from kvcache.setup import backend_for, manager_for
    from kvcache.swap import SwapSpace

_ERRORS = (
    "ArgumentTypeError",
    "BackendUnavailableError",
    "CacheAllocationError",
    "ConfigError",
    "IntegrityError",
    "InvalidArgumentError",
    "KVCacheError",
    "MetadataError",
    "OutOfBlocksError",
    "SequenceExistsError",
    "UnknownSequenceError",
    "UnsupportedSettingError",
)

#: Public name -> the module that defines it.
_HOME = {
    **{name: "attention.errors" for name in _ERRORS},
    "StepCapacity": "attention.staging",
    "BlockAllocator": "kvcache.allocator",
    "MetadataBuilder": "kvcache.builder",
    "build_metadata": "kvcache.builder",
    "KVCacheTensors": "kvcache.cache_tensors",
    "allocate_kv_cache": "kvcache.cache_tensors",
    "resolve_device": "kvcache.cache_tensors",
    "KVCacheConfig": "kvcache.config",
    "load_config": "kvcache.loading",
    "parse_config": "kvcache.loading",
    "BlockManager": "kvcache.manager",
    "CacheStats": "kvcache.metrics",
    "PrometheusExporter": "kvcache.metrics",
    "collect_stats": "kvcache.metrics",
    "CapacityPlan": "kvcache.planning",
    "plan_capacity": "kvcache.planning",
    "preempt": "kvcache.preemption",
    "ScheduledRow": "kvcache.rows",
    "backend_for": "kvcache.setup",
    "manager_for": "kvcache.setup",
    "SwapSpace": "kvcache.swap",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
