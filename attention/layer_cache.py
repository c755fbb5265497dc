"""One layer's view of the paged K/V cache: what ``write_kv`` and ``attend`` read and write."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LayerCache"]


@dataclass(frozen=True)
class LayerCache:
    """One layer's K and V cache tensors.

    key, value: [num_blocks, block_size, num_kv_heads, head_dim], the spec's cache dtype
                (``AttentionSpec.cache_dtype``); key contiguous, value contiguous or
                token-major (:mod:`attention.value_layout`; kvcache stores an 8-bit V so).
    index:      the layer's index in the model (which layers use a sliding window).
    k_scale, v_scale: dequantization scales (the stored value times the scale is the real K/V):
                fp32 [num_kv_heads] for an fp8 cache; fp16 [num_blocks, block_size,
                num_kv_heads], one per token and head, for an int8 cache (views into the
                blocks' memory, :mod:`attention.token_scales`); None for 16/32-bit caches.
    k_centre:   fp32 [num_kv_heads, head_dim] subtracted from every key before an int8 cache
                stores it (key centring, :meth:`kvcache.KVCacheTensors.set_key_centres`), or
                None. It is never added back: it shifts all of a query's scores by the same
                ``q . k_centre``, which the softmax ignores, while the rows left to quantize
                are smaller. Refused with a score cap or attention sinks (not shift-invariant).
    rotation:   fp32 [head_dim, head_dim] orthonormal, or None: the cache holds K and V
                rotated, ``k @ rotation`` and ``v @ rotation`` (:mod:`attention.kv_rotation`);
                ``write_kv`` rotates what it stores, ``attend`` rotates the query and its output
                back, so callers pass and get unrotated tensors. Not with ``k_centre``.
    ``kvcache.KVCacheTensors.layer(i)`` builds these once per layer and hands the same objects
    out every step.
    """

    key: torch.Tensor
    value: torch.Tensor
    index: int = 0
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_centre: torch.Tensor | None = None
    rotation: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.key.shape[1])

    @property
    def num_slots(self) -> int:
        return int(self.key.shape[0] * self.key.shape[1])
