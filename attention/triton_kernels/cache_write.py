"""Cache write: scatter the step's new K/V into their slots of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton_kernels.paging import kernels_interpreted, next_power_of_2

__all__ = ["quantize_int8_rows", "write_kv_cache"]

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
def _round_to_bf16_grid(x):  # type: ignore[no-untyped-def]
    """Round fp32 ``x`` to bf16's 8 significant bits (to nearest, ties to even) with integer
    ops, keeping it fp32. Only under Triton's CPU interpreter, whose fp32 to bf16 cast
    truncates; the GPU's conversion rounds to nearest."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def quantize_int8_rows(x, mask):  # type: ignore[no-untyped-def]
    """fp32 ``x`` [rows, n] (one (token, KV head) row each; lanes outside ``mask`` ignored) ->
    (int8 values [rows, n], fp16 scales [rows]) as :func:`attention.token_scales.quantize_rows`
    computes them, bit for bit: ``scale = fp16(min(max|row| / 127, 65504))``, ``y = x /
    scale`` in fp32 with the stored scale, ``sign(y) * floor(|y| + 0.5)`` clamped to +-127,
    and 0 where the scale is 0. Both divisions are IEEE-rounded (``div_rn``): Triton's
    default fp32 division on the GPU is approximate, and one ulp moves a value across a
    rounding boundary."""
    scale = int8_row_scale(tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1))
    return int8_row_values(x, scale), scale


@triton.jit
def int8_row_scale(amax):  # type: ignore[no-untyped-def]
    """fp32 [rows] largest magnitudes -> fp16 [rows] scales (see :func:`quantize_int8_rows`)."""
    return tl.minimum(tl.math.div_rn(amax, 127.0), 65504.0).to(tl.float16)


@triton.jit
def int8_row_values(x, scale):  # type: ignore[no-untyped-def]
    """fp32 ``x`` [rows, n] divided by fp16 ``scale`` [rows] -> int8 (see :func:`quantize_int8_rows`)."""
    s = scale.to(tl.float32)[:, None]
    y = tl.where(s > 0.0, tl.math.div_rn(x, tl.where(s > 0.0, s, 1.0)), 0.0)
    r = tl.minimum(tl.floor(tl.abs(y) + 0.5), 127.0)
    return tl.where(y < 0.0, -r, r).to(tl.int8)


@triton.jit
def _cache_write_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_centre_ptr,
    num_slots,
    stride_sb,
    stride_st,
    stride_sh,
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
    TOKEN_SCALES: tl.constexpr,
    CENTRE_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (token, head chunk): copy BLOCK_H heads of one token's K and V.

    The K cache's strides are (stride_cb, stride_ct, stride_ch, 1); V has its own
    (stride_vb, stride_vs, stride_vc, stride_vd): contiguous like K, or token-major
    (:mod:`attention.value_layout`, stride_vd = block_size).

    A slot outside [0, num_slots) -- the -1 of a padded token, or a corrupt id -- masks the
    whole program off, so nothing but the given slots is ever written. QUANTIZE (an fp8
    cache): store ``x / scale[head]`` saturated to +-448 (float8_e4m3's largest finite value).
    TOKEN_SCALES (an int8 cache, :mod:`attention.token_scales`): each (token, head) row is
    quantized with its own scale (:func:`quantize_int8_rows`), stored at ``k_scale_ptr`` /
    ``v_scale_ptr`` + block * stride_sb + offset * stride_st + head * stride_sh (fp16
    elements; both scale views share these strides). CENTRE_K: K less ``k_centre`` (fp32
    [NUM_KV_HEADS, HEAD_DIM], contiguous) is what an int8 cache quantizes.
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
    if TOKEN_SCALES:
        k = k.to(tl.float32)
        if CENTRE_K:
            k = k - tl.load(k_centre_ptr + h[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        k, k_row_scale = quantize_int8_rows(k, mask)
        v, v_row_scale = quantize_int8_rows(v.to(tl.float32), mask)
        s_dst = block * stride_sb + offset * stride_st + h * stride_sh
        tl.store(k_scale_ptr + s_dst, k_row_scale, mask=h < heads)
        tl.store(v_scale_ptr + s_dst, v_row_scale, mask=h < heads)
    elif QUANTIZE:
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
    k_centre: torch.Tensor | None = None,
) -> None:
    """Write ``key[t]``/``value[t]`` into slot ``slot_mapping[t]`` of ``k_cache``/``v_cache``.

    key, value:       [num_tokens, num_kv_heads, head_dim], the cache dtype; any token/head
                      strides (e.g. views into a fused QKV projection).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same shape; k_cache
                      contiguous, v_cache contiguous or token-major (:mod:`attention.value_layout`).
    slot_mapping:     int64 [num_tokens]; -1 (and any id outside the cache) is skipped.
    k_scale, v_scale: fp32 [num_kv_heads] for an fp8 cache (values are stored divided by them);
                      for an int8 cache (k_cache/v_cache then laid out as
                      :func:`attention.token_scales.split_block_memory` lays them out) the
                      fp16 [num_blocks, block_size, num_kv_heads] per-token scales, written
                      with each row (:func:`attention.token_scales.quantize_rows`, bit for bit).
    k_centre:         an int8 cache's key centre, fp32 [num_kv_heads, head_dim] contiguous:
                      K less it (in fp32) is quantized (``LayerCache.k_centre``); else None.
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
    token_scales = k_cache.dtype == torch.int8
    scale_strides = k_scale.stride() if token_scales and k_scale is not None else (0, 0, 0)
    _cache_write_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if k_scale is not None else slot_mapping,  # unused unless QUANTIZE
        v_scale if v_scale is not None else slot_mapping,
        k_centre if k_centre is not None else slot_mapping,  # unused unless CENTRE_K
        num_blocks * block_size,
        *scale_strides,
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
        QUANTIZE=k_scale is not None and not token_scales,
        TOKEN_SCALES=token_scales,
        CENTRE_K=token_scales and k_centre is not None,
        INTERPRETED=kernels_interpreted(),
        num_warps=4,
    )
