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
        ArgumentTypeError as ArgumentTypeError,
    )
    from attention.errors import (
        BackendUnavailableError as BackendUnavailableError,
    )
    from attention.errors import (
        CacheAllocationError as CacheAllocationError,
    )
    from attention.errors import (
        ConfigError as ConfigError,
    )
    from attention.errors import (
        IntegrityError as IntegrityError,
    )
    from attention.errors import (
        InvalidArgumentError as InvalidArgumentError,
    )
    from attention.errors import (
        KVCacheError as KVCacheError,
    )
    from attention.errors import (
        MetadataError as MetadataError,
    )
    from attention.errors import (
        OutOfBlocksError as OutOfBlocksError,
    )
    from attention.errors import (
        RankDivergenceError as RankDivergenceError,
    )
    from attention.errors import (
        SequenceExistsError as SequenceExistsError,
    )
    from attention.errors import (
        UnknownSequenceError as UnknownSequenceError,
    )
    from attention.errors import (
        UnsupportedSettingError as UnsupportedSettingError,
    )
    from attention.staging import (
        StepCapacity as StepCapacity,
    )
    from kvcache.agreement import (
        RankAgreement as RankAgreement,
    )
    from kvcache.agreement import (
        StepDigest as StepDigest,
    )
    from kvcache.allocator import (
        BlockAllocator as BlockAllocator,
    )
    from kvcache.builder import (
        MetadataBuilder as MetadataBuilder,
    )
    from kvcache.builder import (
        build_metadata as build_metadata,
    )
    from kvcache.cache_tensors import (
        KVCacheTensors as KVCacheTensors,
    )
    from kvcache.cache_tensors import (
        allocate_kv_cache as allocate_kv_cache,
    )
    from kvcache.cache_tensors import (
        resolve_device as resolve_device,
    )
    from kvcache.collective import (
        Collective as Collective,
    )
    from kvcache.collective import (
        SingleProcess as SingleProcess,
    )
    from kvcache.collective import (
        TorchDistributed as TorchDistributed,
    )
    from kvcache.config import (
        KVCacheConfig as KVCacheConfig,
    )
    from kvcache.loading import (
        load_config as load_config,
    )
    from kvcache.loading import (
        parse_config as parse_config,
    )
    from kvcache.manager import (
        BlockManager as BlockManager,
    )
    from kvcache.metrics import (
        CacheStats as CacheStats,
    )
    from kvcache.metrics import (
        PrometheusExporter as PrometheusExporter,
    )
    from kvcache.metrics import (
        collect_stats as collect_stats,
    )
    from kvcache.parallel import (
        TensorParallel as TensorParallel,
    )
    from kvcache.parallel import (
        rank_spec as rank_spec,
    )
    from kvcache.planning import (
        CapacityPlan as CapacityPlan,
    )
    from kvcache.planning import (
        plan_capacity as plan_capacity,
    )
    from kvcache.preemption import (
        preempt as preempt,
    )
    from kvcache.rows import (
        ScheduledRow as ScheduledRow,
    )
    from kvcache.setup import (
        backend_for as backend_for,
    )
    from kvcache.setup import (
        manager_for as manager_for,
    )
    from kvcache.swap import (
        SwapSpace as SwapSpace,
    )

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
    "RankDivergenceError",
    "SequenceExistsError",
    "UnknownSequenceError",
    "UnsupportedSettingError",
)

#: Public name -> the module that defines it.
_HOME = {
    **{name: "attention.errors" for name in _ERRORS},
    "StepCapacity": "attention.staging",
    "RankAgreement": "kvcache.agreement",
    "StepDigest": "kvcache.agreement",
    "BlockAllocator": "kvcache.allocator",
    "MetadataBuilder": "kvcache.builder",
    "build_metadata": "kvcache.builder",
    "KVCacheTensors": "kvcache.cache_tensors",
    "allocate_kv_cache": "kvcache.cache_tensors",
    "resolve_device": "kvcache.cache_tensors",
    "Collective": "kvcache.collective",
    "SingleProcess": "kvcache.collective",
    "TorchDistributed": "kvcache.collective",
    "KVCacheConfig": "kvcache.config",
    "load_config": "kvcache.loading",
    "parse_config": "kvcache.loading",
    "BlockManager": "kvcache.manager",
    "CacheStats": "kvcache.metrics",
    "PrometheusExporter": "kvcache.metrics",
    "collect_stats": "kvcache.metrics",
    "TensorParallel": "kvcache.parallel",
    "rank_spec": "kvcache.parallel",
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
