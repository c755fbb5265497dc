"""Cache write: scatter the step's new K/V into their slots of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton_kernels.paging import kernels_interpreted, next_power_of_2

__all__ = ["write_kv_cache"]

# Elements one program moves per tensor; a [heads, head_dim] tile of this size keeps the
# copy in registers with 16-byte accesses and leaves enough programs to cover the GPU.
_TILE_ELEMENTS = 2048


@triton.jit
def _round_to_e4m3_grid(x):  # type: ignore[no-untyped-def]
    """Round fp32 ``x`` to 3 mantissa bits (to nearest, ties to even) with integer ops, so
    the cast to fp8 that follows is exact. Only under Triton's CPU interpreter, whose fp32 to
    fp8 cast loses the carry when rounding crosses a power of two (7.9 becomes 4, not 8); the
    GPU's conversion instruction rounds correctly and skips this."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cache_write_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_vb,
    stride_vs,
    stride_vc,
    stride_vd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (token, head chunk): copy BLOCK_H heads of one token's K and V.

    The K cache's strides are (stride_cb, stride_ct, stride_ch, 1); V has its own
    (stride_vb, stride_vs, stride_vc, stride_vd): contiguous like K, or token-major
    (:mod:`attention.value_layout`, stride_vd = block_size).

    A slot outside [0, num_slots) -- the -1 of a padded token, or a corrupt id -- masks the
    whole program off, so nothing but the given slots is ever written. QUANTIZE (an fp8
    cache): store ``x / scale[head]`` saturated to +-448 (float8_e4m3's largest finite value).
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D_PAD)
    slot = tl.load(slot_ptr + t)
    # An invalid slot shrinks the head range to nothing (a scalar select rather than
    # scalar & tensor, which the interpreter mistypes).
    heads = tl.where((slot >= 0) & (slot < num_slots), NUM_KV_HEADS, 0)
    mask = (h[:, None] < heads) & (d[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_ct + h[:, None] * stride_ch + d[None, :]
    v_dst = block * stride_vb + offset * stride_vs + h[:, None] * stride_vc + d[None, :] * stride_vd
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if QUANTIZE:
        h_mask = h < heads
        k_scale = tl.load(k_scale_ptr + h, mask=h_mask, other=1.0)
        v_scale = tl.load(v_scale_ptr + h, mask=h_mask, other=1.0)
        k = tl.clamp(k.to(tl.float32) / k_scale[:, None], -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale[:, None], -448.0, 448.0)
        if INTERPRETED:
            k = _round_to_e4m3_grid(k)
            v = _round_to_e4m3_grid(v)
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
    # Otherwise raw copies (no arithmetic), so bf16 needs no upcast even under the interpreter.
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + v_dst, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key[t]``/``value[t]`` into slot ``slot_mapping[t]`` of ``k_cache``/``v_cache``.

    key, value:       [num_tokens, num_kv_heads, head_dim], the cache dtype; any token/head
                      strides (e.g. views into a fused QKV projection).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same shape; k_cache
                      contiguous, v_cache contiguous or token-major (:mod:`attention.value_layout`).
    slot_mapping:     int64 [num_tokens]; -1 (and any id outside the cache) is skipped.
    k_scale, v_scale: fp32 [num_kv_heads] for an fp8 cache (values are stored divided by them).
    Arguments are assumed checked by the caller (``AttentionBackend.write_kv``).
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    d_pad = next_power_of_2(max(head_dim, 16))
    block_h = min(next_power_of_2(kv_heads), max(1, _TILE_ELEMENTS // d_pad))
    grid = (num_tokens, triton.cdiv(kv_heads, block_h))
    _cache_write_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if k_scale is not None else slot_mapping,  # unused unless QUANTIZE
        v_scale if v_scale is not None else slot_mapping,
        num_blocks * block_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_H=block_h,
        BLOCK_SIZE=block_size,
        QUANTIZE=k_scale is not None,
        INTERPRETED=kernels_interpreted(),
        num_warps=4,
    )
