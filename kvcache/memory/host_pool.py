"""What the host-memory pools (swap space, the prefix cache's host tier) share: the check that a
cache serves its manager's block ids, and the block-major host tensor."""

from __future__ import annotations

import torch

from attention.errors import InvalidArgumentError
from kvcache.blocks.manager import BlockManager
from kvcache.memory.cache_tensors import KVCacheTensors

__all__ = ["check_cache_serves", "host_block_pool"]


def check_cache_serves(manager: BlockManager, cache: KVCacheTensors) -> None:
    """Raise InvalidArgumentError unless ``cache`` has a slot for every block id ``manager``
    hands out, at the same block size."""
    if cache.num_blocks < manager.num_blocks or cache.block_size != manager.block_size:
        raise InvalidArgumentError(
            f"cache: {cache.num_blocks} blocks of {cache.block_size} tokens, but the manager hands out "
            f"{manager.num_blocks} blocks of {manager.block_size}; build both from the same config"
        )


def host_block_pool(cache: KVCacheTensors, num_host_blocks: int) -> torch.Tensor:
    """``[num_host_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` in the cache's dtype:
    one host block (every layer's K and V of its tokens) is contiguous and moves in one copy.
    Pinned when the cache is on CUDA."""
    s = cache.storage.shape
    return torch.empty((num_host_blocks, *s[:2], *s[3:]), dtype=cache.dtype, pin_memory=cache.device.type == "cuda")
