"""Construction from a config in one call each: the manager and the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attention.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedSettingError
from attention.registry import BackendChoice, choose_backend
from kvcache.blocks.hybrid import AnyBlockManager, HybridBlockManager
from kvcache.blocks.manager import BlockManager
from kvcache.config.schema import KVCacheConfig

if TYPE_CHECKING:
    from attention.spec import AttentionSpec
    from kvcache.blocks.groups import KVGroupLayout
    from kvcache.memory.cache_tensors import KVCacheTensors
    from kvcache.parallel.heads import TensorParallel

__all__ = ["backend_for", "manager_for"]


def manager_for(
    config: KVCacheConfig,
    cache: KVCacheTensors,
    *,
    prefix_caching: bool | None = None,
    spec: AttentionSpec | None = None,
) -> AnyBlockManager:
    """A block manager over ``cache``'s blocks, with the config's block size, prefix caching
    (``prefix_caching`` overrides ``cache.enable_prefix_caching``) and its host tier
    (``cache.host_cache_space``: ``manager.lower_tier``) with its disk tier
    (``cache.disk_cache_dir``, ``cache.disk_cache_space``), and sliding-window block release when
    every layer is windowed (in ``spec``, the model's attention; default: the config's).

    A cache allocated with KV groups (``cache.layout``: a model mixing full and windowed
    layers) gets a :class:`HybridBlockManager` over its block ids instead: each group its own
    tables, the windowed ones releasing blocks behind their window. It has no host or disk
    tier yet (UnsupportedSettingError when the config asks for one).

    Under tensor parallelism every rank builds the same manager (same block count, same
    settings): block ids are shared by all ranks, each rank's blocks hold its own KV heads."""
    if cache.block_size != config.cache.block_size:
        raise InvalidArgumentError(
            f"cache: blocks of {cache.block_size} tokens, but the config's cache.block_size is "
            f"{config.cache.block_size}; allocate the cache from this config (allocate_kv_cache(config))"
        )
    if prefix_caching is not None and not isinstance(prefix_caching, bool):
        raise ArgumentTypeError(
            f"prefix_caching: expected True, False or None (the config's), got {type(prefix_caching).__name__}"
        )
    spec = spec or config.attention_spec()
    caching = config.cache.enable_prefix_caching if prefix_caching is None else prefix_caching
    if cache.layout is not None:
        layout = cache.layout
        windowed = tuple(spec.window_of(i) is not None for i in range(layout.num_layers))
        if windowed != tuple(layout.place(i)[0] >= _full_groups(layout) for i in range(layout.num_layers)):
            raise UnsupportedSettingError(
                "cache: its KV groups do not follow the model's window pattern; allocate the cache with "
                "the layout of this spec (allocate_kv_cache(..., layout=group_layout(...)))"
            )
        if config.cache.host_cache_space:
            raise UnsupportedSettingError(
                f"cache.host_cache_space: {config.cache.host_cache_space} bytes, but a model with KV groups "
                "(full and windowed layers) has no host tier yet; set host_cache_space to 0, or keep one table "
                "for every layer (the example engine: --no-kv-groups)"
            )
        return HybridBlockManager(layout, cache.num_blocks, config.cache.block_size, caching)
    release_window = spec.sliding_window if not spec.has_full_layers else None
    manager = BlockManager(
        cache.num_blocks,
        config.cache.block_size,
        enable_prefix_caching=caching,
        sliding_window=release_window,
    )
    if config.cache.host_cache_space and manager.prefix_cache is not None:
        from kvcache.memory.host_tier import HostPrefixTier

        HostPrefixTier.for_bytes(  # manager.lower_tier
            manager,
            cache,
            config.cache.host_cache_space,
            disk_dir=config.cache.disk_cache_dir,
            disk_bytes=config.cache.disk_cache_space,
        )
    return manager


def _full_groups(layout: KVGroupLayout) -> int:
    """How many groups come first with full attention (the layout puts them first)."""
    return sum(1 for group in layout.groups if group.window is None)


def backend_for(
    config: KVCacheConfig, device_type: str, name: str | None = None, *, tp: TensorParallel | None = None
) -> BackendChoice:
    """The config's ``attention.backend`` (or ``name``) for ``device_type`` ("cpu"/"cuda"),
    with ``auto`` resolved and the reason for the choice; with ``tp``, built for that rank's
    heads. Raises UnsupportedSettingError or BackendUnavailableError with the fix, and
    InvalidArgumentError when the heads do not split over ``tp.size`` ranks."""
    return choose_backend(
        name or config.attention.backend,
        config.attention_spec(tp),
        device_type=device_type,
        block_size=config.cache.block_size,
    )
