"""A paged KV-cache manager: YAML config, block allocator, block tables, cache tensors.

The attention kernels that read the cache live in the sibling package :mod:`attention`.
This module is the public face: import from here. Names are imported lazily, so ``kvcache
validate`` and other config-only uses never import torch. The subpackages, lowest first:

| module | what it holds |
| --- | --- |
| ``parallel`` | tensor parallelism: per-rank KV heads (``heads``), rank agreement, collectives |
| ``config`` | YAML read safely and validated into a frozen config; capacity planning |
| ``blocks`` | the block core: allocator, block tables, prefix cache (pure Python) |
| ``memory`` | the cache tensors on the device, the host swap tier, preemption |
| ``step`` | per-step metadata and plan in persistent buffers; CUDA graphs |

``cli`` (the ``kvcache`` command), ``setup`` (a manager and a backend from a config) and
``metrics`` sit on top. Module paths from before the subpackages still import
(:mod:`kvcache.moved`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvcache import moved

moved.install()

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
    from kvcache.blocks.allocator import (
        BlockAllocator as BlockAllocator,
    )
    from kvcache.blocks.digest import (
        block_digests as block_digests,
    )
    from kvcache.blocks.events import (
        AllCleared as AllCleared,
    )
    from kvcache.blocks.events import (
        BlockRemoved as BlockRemoved,
    )
    from kvcache.blocks.events import (
        BlockStored as BlockStored,
    )
    from kvcache.blocks.events import (
        KVEvent as KVEvent,
    )
    from kvcache.blocks.events import (
        Subscription as Subscription,
    )
    from kvcache.blocks.groups import (
        KVGroup as KVGroup,
    )
    from kvcache.blocks.groups import (
        KVGroupLayout as KVGroupLayout,
    )
    from kvcache.blocks.groups import (
        group_layout as group_layout,
    )
    from kvcache.blocks.hybrid import (
        AnyBlockManager as AnyBlockManager,
    )
    from kvcache.blocks.hybrid import (
        HybridBlockManager as HybridBlockManager,
    )
    from kvcache.blocks.manager import (
        BlockManager as BlockManager,
    )
    from kvcache.blocks.rows import (
        ScheduledRow as ScheduledRow,
    )
    from kvcache.config.loading import (
        load_config as load_config,
    )
    from kvcache.config.loading import (
        parse_config as parse_config,
    )
    from kvcache.config.planning import (
        CapacityPlan as CapacityPlan,
    )
    from kvcache.config.planning import (
        plan_capacity as plan_capacity,
    )
    from kvcache.config.schema import (
        KVCacheConfig as KVCacheConfig,
    )
    from kvcache.memory.cache_tensors import (
        KVCacheTensors as KVCacheTensors,
    )
    from kvcache.memory.cache_tensors import (
        allocate_kv_cache as allocate_kv_cache,
    )
    from kvcache.memory.cache_tensors import (
        resolve_device as resolve_device,
    )
    from kvcache.memory.disk_tier import (
        DiskPrefixTier as DiskPrefixTier,
    )
    from kvcache.memory.disk_tier import (
        DiskTierStats as DiskTierStats,
    )
    from kvcache.memory.host_tier import (
        HostPrefixTier as HostPrefixTier,
    )
    from kvcache.memory.host_tier import (
        HostTierStats as HostTierStats,
    )
    from kvcache.memory.preemption import (
        preempt as preempt,
    )
    from kvcache.memory.swap import (
        SwapSpace as SwapSpace,
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
    from kvcache.parallel.agreement import (
        RankAgreement as RankAgreement,
    )
    from kvcache.parallel.agreement import (
        StepDigest as StepDigest,
    )
    from kvcache.parallel.collective import (
        Collective as Collective,
    )
    from kvcache.parallel.collective import (
        SingleProcess as SingleProcess,
    )
    from kvcache.parallel.collective import (
        TorchDistributed as TorchDistributed,
    )
    from kvcache.parallel.heads import (
        TensorParallel as TensorParallel,
    )
    from kvcache.parallel.heads import (
        rank_spec as rank_spec,
    )
    from kvcache.setup import (
        backend_for as backend_for,
    )
    from kvcache.setup import (
        manager_for as manager_for,
    )
    from kvcache.step.builder import (
        MetadataBuilder as MetadataBuilder,
    )
    from kvcache.step.builder import (
        build_metadata as build_metadata,
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
    "RankAgreement": "kvcache.parallel.agreement",
    "StepDigest": "kvcache.parallel.agreement",
    "BlockAllocator": "kvcache.blocks.allocator",
    "MetadataBuilder": "kvcache.step.builder",
    "build_metadata": "kvcache.step.builder",
    "KVCacheTensors": "kvcache.memory.cache_tensors",
    "allocate_kv_cache": "kvcache.memory.cache_tensors",
    "resolve_device": "kvcache.memory.cache_tensors",
    "Collective": "kvcache.parallel.collective",
    "SingleProcess": "kvcache.parallel.collective",
    "TorchDistributed": "kvcache.parallel.collective",
    "KVCacheConfig": "kvcache.config.schema",
    "load_config": "kvcache.config.loading",
    "parse_config": "kvcache.config.loading",
    "BlockManager": "kvcache.blocks.manager",
    "AnyBlockManager": "kvcache.blocks.hybrid",
    "HybridBlockManager": "kvcache.blocks.hybrid",
    "KVGroup": "kvcache.blocks.groups",
    "KVGroupLayout": "kvcache.blocks.groups",
    "group_layout": "kvcache.blocks.groups",
    "block_digests": "kvcache.blocks.digest",
    **{name: "kvcache.blocks.events" for name in ("AllCleared", "BlockRemoved", "BlockStored", "KVEvent")},
    "Subscription": "kvcache.blocks.events",
    "CacheStats": "kvcache.metrics",
    "PrometheusExporter": "kvcache.metrics",
    "collect_stats": "kvcache.metrics",
    "TensorParallel": "kvcache.parallel.heads",
    "rank_spec": "kvcache.parallel.heads",
    "CapacityPlan": "kvcache.config.planning",
    "plan_capacity": "kvcache.config.planning",
    "preempt": "kvcache.memory.preemption",
    "ScheduledRow": "kvcache.blocks.rows",
    "backend_for": "kvcache.setup",
    "manager_for": "kvcache.setup",
    "SwapSpace": "kvcache.memory.swap",
    "DiskPrefixTier": "kvcache.memory.disk_tier",
    "DiskTierStats": "kvcache.memory.disk_tier",
    "HostPrefixTier": "kvcache.memory.host_tier",
    "HostTierStats": "kvcache.memory.host_tier",
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
