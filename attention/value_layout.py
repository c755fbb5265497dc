"""Where a V cache keeps its tokens: the two memory layouts the kernels read.

Every K and V cache has the logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]``
and is indexed that way in torch. In memory, V comes in one of two layouts:

- **contiguous** (K always, and V of 16/32-bit caches): each block is
  ``[block_size, kv_heads, head_dim]``, a token's head_dim values side by side.
- **token-major** (V of 8-bit caches, as ``kvcache`` allocates them): each block is
  ``[kv_heads, head_dim, block_size]``, one (head, dimension)'s values of the block's tokens
  side by side. The tensor is a permuted view of that memory, so torch code indexes it like
  any other cache; only its strides differ.

Why: in P @ V the tokens are the reduction dimension. Triton 3.6 feeds an 8-bit tensor-core
operand whose reduction dimension is not contiguous in shared memory one byte at a time (128
``ld.shared.b8`` per tile of the fp8 decode kernel, compiled for sm_90), which held fp8 decode
at 67-75% of the copy bandwidth. With the tokens contiguous those reads become ``ldmatrix``,
as for K. On the H200, on KV-bound batches, fp8 decode against the bf16 cache went from
1.06-1.31x (block 32) and 1.29-1.57x (block 256) with a contiguous V
(benchmarks/results/decode-fp8-vmajor-2026-12-03.json) to 1.32-1.41x and 1.51-1.63x, fp8
bytes at 77-80% of the copy rate (decode-fp8-vmajor-final-2026-12-03.json). Prefill pays
3-9% for it (prefill-fp8-vmajor-2026-12-03.json). vLLM's
first paged-attention kernel stored V with the block's tokens innermost for the same
reduction.

The kernels read V tiles of this layout unmasked along the tokens (a per-token mask would
split the 16-byte loads into bytes) from block ids inside the cache, and make non-finite
values finite (:func:`attention.triton_kernels.paging.finite_operand`, or for float8_e4m3fn,
whose only non-finite value is NaN, ``finite_e4m3_operand``): slots past a row's end may hold
any bits, and a probability of 0 times NaN is still NaN.

A block's bytes are one contiguous run in either layout, so block copies, swap, the host and
disk tiers and prefix-cache digests move blocks without knowing the layout.
"""

from __future__ import annotations

import torch

__all__ = ["is_token_major", "token_major_view", "uses_token_major_values", "value_is_readable"]


def uses_token_major_values(cache_dtype: torch.dtype) -> bool:
    """Whether ``kvcache`` allocates V token-major for a cache of ``cache_dtype``: 8-bit caches."""
    return cache_dtype.itemsize == 1


def token_major_view(block_memory: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[num_blocks, block_size, kv_heads, head_dim]`` tensor's memory, read as
    token-major V: ``[num_blocks, kv_heads, head_dim, block_size]`` permuted back to the
    logical shape (a view: writes go to ``block_memory``)."""
    if block_memory.dim() != 4 or not block_memory.is_contiguous():
        raise ValueError(
            f"block_memory: expected a contiguous [num_blocks, block_size, kv_heads, head_dim] tensor, got "
            f"{tuple(block_memory.shape)} with strides {block_memory.stride()}"
        )
    n, bs, kvh, d = block_memory.shape
    return block_memory.view(n, kvh, d, bs).permute(0, 3, 1, 2)


def is_token_major(value: torch.Tensor) -> bool:
    """Whether a 4-d V cache has the token-major strides of :func:`token_major_view` (and is
    not also contiguous, which a block of one token would be)."""
    if value.dim() != 4 or value.is_contiguous():
        return False
    _, bs, kvh, d = value.shape
    expected = (kvh * d * bs, 1, d * bs, bs)
    return all(size == 1 or got == want for size, got, want in zip(value.shape, value.stride(), expected, strict=True))


def value_is_readable(value: torch.Tensor) -> bool:
    """Whether the kernels read this V cache: contiguous or token-major."""
    return value.is_contiguous() or is_token_major(value)
