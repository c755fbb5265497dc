"""K/V cache quantization in plain torch (the reference's, and the oracle for the kernels).

An fp8 cache stores ``x / scale`` per KV head, saturated to the format's finite range; reading
multiplies back. An int8 cache stores each (token, KV head) row with its own scale
(:mod:`attention.token_scales`). 16- and 32-bit caches store values as they are (no scale).
"""

from __future__ import annotations

import torch

from attention.token_scales import dequantize_rows

__all__ = ["FP8_MAX", "dequantize", "is_fp8", "quantize"]

#: Largest finite value of torch.float8_e4m3fn.
FP8_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn,)


def quantize(x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype) -> torch.Tensor:
    """x: [tokens, kv_heads, head_dim] -> the cache's dtype. ``scale``: fp32 [kv_heads] for an
    fp8 cache (None otherwise)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    if scale is None:
        raise ValueError("scale: an fp8 cache needs its per-KV-head scales")
    scaled = x.float() / scale.float()[None, :, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """cache: [num_blocks, block_size, kv_heads, head_dim] (or any [..., kv_heads, head_dim])
    -> values in ``dtype``. ``scale``: fp32 [kv_heads] for fp8; fp16 [num_blocks, block_size,
    kv_heads] (per token) for int8."""
    if cache.dtype == torch.int8:
        if scale is None:
            raise ValueError("scale: an int8 cache needs its per-token scales")
        return dequantize_rows(cache, scale, dtype)
    if not is_fp8(cache.dtype):
        return cache.to(dtype)
    if scale is None:
        raise ValueError("scale: an fp8 cache needs its per-KV-head scales")
    return cache.to(dtype) * scale.to(dtype)[:, None]
