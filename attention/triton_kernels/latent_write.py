"""MLA's boundary before attention in one kernel: rotary on the query's and the latent's
rotary channels, the latent into its cache slot, and the attention query assembled
(instead of two rotations of a dozen elementwise ops each, two concatenations and the
cache write).

Numbers follow the composed form (:func:`attention.latent_boundary.compose_latent_boundary`):
float32 rotation, one rounding to the input's dtype, and for an fp8 latent the cache
write's scaling and saturation of that rounded value, so under the interpreter both store
the same bits (on a GPU the rotation's products may fuse into FMAs: at most an ulp apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton_kernels.cache_write import _round_to_e4m3_grid
from attention.triton_kernels.paging import kernels_interpreted, next_power_of_2
from attention.triton_kernels.rotary_write import _as_input_dtype

__all__ = ["rotary_write_latent"]

# Elements of the absorbed query one program copies: a [heads, latent rank] tile of this
# size stays in registers and leaves several programs per token.
_TILE_ELEMENTS = 4096


@triton.jit
def _load_rotated(ptr, j, mask, cos, sin, HALF: tl.constexpr, PAIRS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The rotary channels at ``ptr`` ([rows, 1] offsets; lanes ``j`` < HALF) rotated in
    float32, as halves ``(lo, hi)``. PAIRS: the input interleaves them, ``(x0, x1), (x2,
    x3), ...``, read as ``lo = x[2j]``, ``hi = x[2j + 1]``; else ``lo = x[j]``, ``hi = x[j +
    HALF]``."""
    if PAIRS:
        lo = tl.load(ptr + 2 * j[None, :], mask=mask).to(tl.float32)
        hi = tl.load(ptr + 2 * j[None, :] + 1, mask=mask).to(tl.float32)
    else:
        lo = tl.load(ptr + j[None, :], mask=mask).to(tl.float32)
        hi = tl.load(ptr + HALF + j[None, :], mask=mask).to(tl.float32)
    return lo * cos[None, :] - hi * sin[None, :], hi * cos[None, :] + lo * sin[None, :]


@triton.jit
def _to_cache(x, scale, cache_dtype, QUANTIZE: tl.constexpr, INTERPRETED: tl.constexpr):  # type: ignore[no-untyped-def]
    """fp32 ``x`` (on the input dtype's grid) as the cache stores it: divided by ``scale`` and
    saturated to +-448 for an fp8 latent, as the cache write does."""
    if QUANTIZE:
        x = tl.clamp(x / scale, -448.0, 448.0)
        if INTERPRETED:
            x = _round_to_e4m3_grid(x)
    return x.to(cache_dtype)


@triton.jit
def _latent_boundary_kernel(  # type: ignore[no-untyped-def]
    q_latent_ptr,
    q_pe_ptr,
    latent_ptr,
    key_pe_ptr,
    query_ptr,
    cache_ptr,
    slot_ptr,
    pos_ptr,
    rows_ptr,
    cos_sin_ptr,
    scale_ptr,
    num_heads,
    num_slots,
    max_position,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_lt,
    stride_kt,
    stride_cb,
    stride_ct,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAIRS: tl.constexpr,
    QUANTIZE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (token t, head chunk): query[t, h] = [q_latent[t, h], rotate(q_pe[t, h])] for
    the chunk's BLOCK_H heads, a new contiguous [T, H, RANK + 2 HALF] (under ``HAS_ROWS`` a
    token whose ``rows_ptr`` entry is negative gets the rotary part only); the first chunk's
    program also stores [latent[t], rotate(key_pe[t])] into slot ``slot_ptr[t]`` of the
    cache (strides (stride_cb, stride_ct, 1, 1), one latent per slot). A slot outside
    [0, num_slots) (the -1 of a padding token, or a corrupt id) writes nothing; a position
    outside the table is clamped into it, as :func:`attention.rotary.rotate` clamps."""
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    dtype = query_ptr.dtype.element_ty
    width = RANK + 2 * HALF
    position = tl.minimum(tl.maximum(tl.load(pos_ptr + t), 0), max_position - 1)
    j = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + j, mask=j < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + j, mask=j < HALF, other=0.0)
    r = tl.arange(0, RANK_PAD)

    # The query: the absorbed part copied, the rotary part rotated.
    h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h[:, None] < num_heads
    copied = RANK
    if HAS_ROWS:  # a token the absorbed kernel skips needs no absorbed query
        copied = tl.where(tl.load(rows_ptr + t) >= 0, RANK, 0)
    r_mask = h_mask & (r[None, :] < copied)
    q_latent = tl.load(q_latent_ptr + t * stride_qlt + h[:, None] * stride_qlh + r[None, :], mask=r_mask)
    out = query_ptr + t * num_heads * width + h[:, None] * width
    tl.store(out + r[None, :], q_latent, mask=r_mask)
    pe_mask = h_mask & (j[None, :] < HALF)
    lo, hi = _load_rotated(q_pe_ptr + t * stride_qpt + h[:, None] * stride_qph, j, pe_mask, cos, sin, HALF, PAIRS)
    tl.store(out + RANK + j[None, :], _as_input_dtype(lo, dtype, INTERPRETED).to(dtype), mask=pe_mask)
    tl.store(out + RANK + HALF + j[None, :], _as_input_dtype(hi, dtype, INTERPRETED).to(dtype), mask=pe_mask)

    # The latent, from the first chunk's program when its slot is in the cache. An invalid
    # slot shrinks the lanes to nothing (scalar selects, not scalar & tensor, which the
    # interpreter mistypes).
    slot = tl.load(slot_ptr + t)
    valid = (slot >= 0) & (slot < num_slots) & (chunk == 0)
    c_mask = r[None, :] < tl.where(valid, RANK, 0)
    k_mask = j[None, :] < tl.where(valid, HALF, 0)
    scale = tl.load(scale_ptr)  # only read when QUANTIZE
    cache_dtype = cache_ptr.dtype.element_ty
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    c = tl.load(latent_ptr + t * stride_lt + r[None, :], mask=c_mask)
    if QUANTIZE:
        c = _to_cache(c.to(tl.float32), scale, cache_dtype, QUANTIZE, INTERPRETED)
    tl.store(dst + r[None, :], c, mask=c_mask)
    k_lo, k_hi = _load_rotated(key_pe_ptr + t * stride_kt, j, k_mask, cos, sin, HALF, PAIRS)
    k_lo = _to_cache(_as_input_dtype(k_lo, dtype, INTERPRETED), scale, cache_dtype, QUANTIZE, INTERPRETED)
    k_hi = _to_cache(_as_input_dtype(k_hi, dtype, INTERPRETED), scale, cache_dtype, QUANTIZE, INTERPRETED)
    tl.store(dst + RANK + j[None, :], k_lo, mask=k_mask)
    tl.store(dst + RANK + HALF + j[None, :], k_hi, mask=k_mask)


def rotary_write_latent(
    query_latent: torch.Tensor,
    query_pe: torch.Tensor,
    latent: torch.Tensor,
    key_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    scale: torch.Tensor | None,
    *,
    pairs: bool,
    token_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``[latent[t], rotate(key_pe[t])]`` into slot ``slot_mapping[t]`` of ``cache`` and
    return the query ``[query_latent, rotate(query_pe)]``.

    query_latent: [T, H, r], query_pe: [T, H, e]; latent: [T, r], key_pe: [T, e]; the compute
                  dtype, any token/head strides, unit stride along channels.
    cache:        [num_blocks, block_size, 1, r + e], contiguous (the compute dtype, or fp8
                  with ``scale`` fp32 [1]: values stored divided by it, saturated).
    slot_mapping: int64 [T] (-1 and any id outside the cache skipped); positions: int64 [T].
    cos_sin:      float32 [max_positions, e] (:class:`attention.rotary.RotaryTable`).
    pairs:        the rotary channels of ``query_pe`` and ``key_pe`` come interleaved
                  (DeepSeek's ``rope_interleave``); both leave as halves.
    token_rows:   int32 [T] or None: the absorbed kernel's table row of each token; a token
                  with a negative one (padding, a row attending decompressed) gets only its
                  rotary channels, its first r left unset (``query_latent`` is not read there).
    Returns a new contiguous [T, H, r + e]. Arguments are assumed checked by the caller
    (``AttentionBackend.rotary_write_latent``).
    """
    tokens, heads, rank = query_latent.shape
    rope = query_pe.shape[2]
    query = torch.empty((tokens, heads, rank + rope), dtype=query_latent.dtype, device=query_latent.device)
    if tokens == 0:
        return query
    num_blocks, block_size = cache.shape[:2]
    rank_pad = next_power_of_2(max(rank, 16))
    block_h = min(next_power_of_2(heads), max(1, _TILE_ELEMENTS // rank_pad))
    quantize = scale is not None
    _latent_boundary_kernel[(tokens, triton.cdiv(heads, block_h))](
        query_latent,
        query_pe,
        latent,
        key_pe,
        query,
        cache,
        slot_mapping,
        positions,
        token_rows if token_rows is not None else slot_mapping,  # read only under HAS_ROWS
        cos_sin,
        scale if scale is not None else cos_sin,  # read, unused, unless QUANTIZE
        heads,
        num_blocks * block_size,
        cos_sin.shape[0],
        query_latent.stride(0),
        query_latent.stride(1),
        query_pe.stride(0),
        query_pe.stride(1),
        latent.stride(0),
        key_pe.stride(0),
        cache.stride(0),
        cache.stride(1),
        RANK=rank,
        RANK_PAD=rank_pad,
        HALF=rope // 2,
        HALF_PAD=next_power_of_2(max(rope // 2, 16)),
        BLOCK_H=block_h,
        BLOCK_SIZE=block_size,
        PAIRS=pairs,
        QUANTIZE=quantize,
        HAS_ROWS=token_rows is not None,
        INTERPRETED=kernels_interpreted(),
        num_warps=4,
    )
    return query
