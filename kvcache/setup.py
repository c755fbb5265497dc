"""Construction from a config in one call each: the manager and the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attention.registry import BackendChoice, choose_backend
from kvcache.config import KVCacheConfig
from kvcache.manager import BlockManager

if TYPE_CHECKING:
    from kvcache.cache_tensors import KVCacheTensors

__all__ = ["backend_for", "manager_for"]


def manager_for(config: KVCacheConfig, cache: KVCacheTensors, *, prefix_caching: bool | None = None) -> BlockManager:
    """A block manager over ``cache``'s blocks, with the config's block size, prefix caching
    (``prefix_caching`` overrides ``cache.enable_prefix_caching``), and sliding-window block
    release when every layer is windowed."""
    spec = config.attention_spec()
    release_window = spec.sliding_window if not spec.has_full_layers else None
    return BlockManager(
        cache.num_blocks,
        config.cache.block_size,
        enable_prefix_caching=config.cache.enable_prefix_caching if prefix_caching is None else prefix_caching,
        sliding_window=release_window,
    )


def backend_for(config: KVCacheConfig, device_type: str, name: str | None = None) -> BackendChoice:
    """The config's ``attention.backend`` (or ``name``) for ``device_type`` ("cpu"/"cuda"),
    with ``auto`` resolved and the reason for the choice. Raises UnsupportedSettingError or
    BackendUnavailableError with the fix."""
    return choose_backend(
        name or config.attention.backend,
        config.attention_spec(),
        device_type=device_type,
        block_size=config.cache.block_size,
    )
