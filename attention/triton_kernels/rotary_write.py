"""The fused boundary before attention: rotary on Q and K, K and V into their cache slots, and
the rotated Q, in one kernel (instead of a gather, a dozen elementwise ops and the cache write).

Numbers follow :func:`attention.rotary.rotate`: float32 math, one rounding to the output dtype
(and, for an fp8 cache, the same scaling and saturation as the cache write). For an int8
cache the rotated K is first rounded to the input's dtype, as the composed boundary
(:func:`attention.rotary.rotate`, then the cache write) rounds it, so both store the same bits.

A cache stored in a rotated basis (:mod:`attention.kv_rotation`) gets K and V multiplied by
its matrix here too, as the composed boundary does: K after rotary, both rounded to the
input's dtype before and after the product (a [heads, head_dim] x [head_dim, head_dim] dot in
four quarters, the halves this kernel holds), so the cache write needs no products of its own.
The query leaves unrotated: :meth:`attention.base.AttentionBackend.attend` rotates it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton_kernels.cache_write import (
    _round_to_bf16_grid,
    _round_to_e4m3_grid,
    int8_row_scale,
    int8_row_values,
)
from attention.triton_kernels.paging import kernels_interpreted, next_power_of_2
from attention.triton_kernels.value_runs import _in_value_run, _value_run_in_window, value_runs_for

__all__ = ["rotary_write_kv", "value_runs_launched"]

# Channel pairs one program holds per tensor: a [heads, head_dim / 2] tile of this size keeps
# the rotation in registers and leaves several programs per token.
_TILE_ELEMENTS = 2048


@triton.jit
def _rotate_tile(ptr, base, j, mask, cos, sin, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    """Load channels ``j`` and ``j + HALF`` of the heads at ``ptr + base`` ([heads, 1] offsets);
    return both rotated halves in float32."""
    lo = tl.load(ptr + base + j[None, :], mask=mask).to(tl.float32)
    hi = tl.load(ptr + base + HALF + j[None, :], mask=mask).to(tl.float32)
    return lo * cos[None, :] - hi * sin[None, :], hi * cos[None, :] + lo * sin[None, :]


@triton.jit
def _quantize(x, scale_ptr, h, h_mask, dtype, INTERPRETED: tl.constexpr):  # type: ignore[no-untyped-def]
    """fp32 ``x`` [heads, n] divided by the heads' scales, saturated to +-448, as ``dtype``."""
    scale = tl.load(scale_ptr + h, mask=h_mask, other=1.0)
    x = tl.clamp(x / scale[:, None], -448.0, 448.0)
    if INTERPRETED:
        x = _round_to_e4m3_grid(x)
    return x.to(dtype)


@triton.jit
def _as_input_dtype(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):  # type: ignore[no-untyped-def]
    """fp32 ``x`` rounded to ``dtype`` (to nearest even) and back to fp32 (the interpreter's
    fp32 to bf16 cast truncates, so there bf16 is rounded with integer ops)."""
    if INTERPRETED and dtype == tl.bfloat16:
        return _round_to_bf16_grid(x)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _basis_quarter(  # type: ignore[no-untyped-def]
    rot_ptr, ROW0: tl.constexpr, COL0: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr
):
    """The [HALF_PAD, HALF_PAD] quarter of the [2 HALF, 2 HALF] matrix at ``rot_ptr`` from
    row ROW0 and column COL0 (each 0 or HALF); zero past HALF."""
    j = tl.arange(0, HALF_PAD)
    mask = (j[:, None] < HALF) & (j[None, :] < HALF)
    return tl.load(rot_ptr + (ROW0 + j)[:, None] * (2 * HALF) + (COL0 + j)[None, :], mask=mask, other=0.0)


@triton.jit
def _to_basis(  # type: ignore[no-untyped-def]
    lo, hi, mask, r00, r01, r10, r11, dtype: tl.constexpr, INTERPRETED: tl.constexpr
):
    """fp32 rows ``[lo | hi]`` ([heads, HALF_PAD] each; lanes outside ``mask`` read as 0)
    times the [2 HALF, 2 HALF] matrix whose quarters are ``r00 .. r11`` (:func:`_basis_quarter`,
    of ``dtype``, the input's): the rows rounded to ``dtype``, fp32 sums, the result rounded to
    ``dtype``; returned as fp32 halves."""
    a = tl.where(mask, _as_input_dtype(lo, dtype, INTERPRETED), 0.0)
    b = tl.where(mask, _as_input_dtype(hi, dtype, INTERPRETED), 0.0)
    if INTERPRETED or dtype == tl.float32:
        # fp32 products of values on dtype's grid (the interpreter has no 16-bit dots); no
        # TF32, so they are as exact as the composed boundary's.
        r00, r01, r10, r11 = r00.to(tl.float32), r01.to(tl.float32), r10.to(tl.float32), r11.to(tl.float32)
        new_lo = tl.dot(a, r00, input_precision="ieee") + tl.dot(b, r10, input_precision="ieee")
        new_hi = tl.dot(a, r01, input_precision="ieee") + tl.dot(b, r11, input_precision="ieee")
    else:
        a, b = a.to(dtype), b.to(dtype)
        new_lo = tl.dot(a, r00) + tl.dot(b, r10)
        new_hi = tl.dot(a, r01) + tl.dot(b, r11)
    return _as_input_dtype(new_lo, dtype, INTERPRETED), _as_input_dtype(new_hi, dtype, INTERPRETED)


@triton.jit
def _store_int8_halves(  # type: ignore[no-untyped-def]
    lo, hi, mask, cache_ptr, dst, stride_d, scale_ptr, s_dst, s_mask, HALF: tl.constexpr
):
    """Quantize rows whose halves are fp32 ``lo`` / ``hi`` [heads, HALF_PAD] (lanes outside
    ``mask`` ignored) with one scale per row over both halves, as
    :func:`~.cache_write.quantize_int8_rows` does; store the int8 values at ``cache_ptr +
    dst`` (+ ``HALF * stride_d`` for the upper half) and the fp16 scales at ``scale_ptr +
    s_dst`` where ``s_mask``."""
    amax = tl.maximum(tl.max(tl.where(mask, tl.abs(lo), 0.0), axis=1), tl.max(tl.where(mask, tl.abs(hi), 0.0), axis=1))
    scale = int8_row_scale(amax)
    tl.store(cache_ptr + dst, int8_row_values(lo, scale), mask=mask)
    tl.store(cache_ptr + dst + HALF * stride_d, int8_row_values(hi, scale), mask=mask)
    tl.store(scale_ptr + s_dst, scale, mask=s_mask)


@triton.jit
def _store_values(  # type: ignore[no-untyped-def]
    v_lo, v_hi, mask, row_mask, heads, v_cache_ptr, v_dst, stride_vd, v_scale_ptr, s_dst,
    HALF: tl.constexpr, QUANTIZE: tl.constexpr, TOKEN_SCALES: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Store V rows whose halves are ``v_lo`` / ``v_hi`` ([rows, HALF_PAD], the input's dtype;
    lanes outside ``mask`` not stored) at ``v_cache_ptr + v_dst`` (+ ``HALF * stride_d`` for
    the upper half): TOKEN_SCALES, int8 with one scale a row (stored at ``v_scale_ptr + s_dst``
    where ``row_mask``); QUANTIZE, fp8 divided by the scales of KV heads ``heads`` ([rows]);
    else as given. The one V write of both :func:`_rotary_write_kernel` (rows: KV heads of a
    token) and :func:`_value_runs_kernel` (rows: tokens of a head), so both store the same
    bytes."""
    if TOKEN_SCALES:
        _store_int8_halves(
            v_lo.to(tl.float32), v_hi.to(tl.float32), mask, v_cache_ptr, v_dst, stride_vd, v_scale_ptr, s_dst,
            row_mask, HALF,
        )  # fmt: skip
    else:
        if QUANTIZE:
            dtype = v_cache_ptr.dtype.element_ty
            lo = _quantize(v_lo.to(tl.float32), v_scale_ptr, heads, row_mask, dtype, INTERPRETED)
            hi = _quantize(v_hi.to(tl.float32), v_scale_ptr, heads, row_mask, dtype, INTERPRETED)
        else:  # a raw copy (no arithmetic), so bf16 needs no upcast under the interpreter
            lo = v_lo
            hi = v_hi
        tl.store(v_cache_ptr + v_dst, lo, mask=mask)
        tl.store(v_cache_ptr + v_dst + HALF * stride_vd, hi, mask=mask)


@triton.jit
def _value_to_basis(  # type: ignore[no-untyped-def]
    v_lo, v_hi, mask, r00, r01, r10, r11, dtype: tl.constexpr, INTERPRETED: tl.constexpr
):
    """V rows' halves (``dtype``, the input's) times the cache's basis (:func:`_to_basis`),
    back in ``dtype``."""
    lo, hi = _to_basis(v_lo.to(tl.float32), v_hi.to(tl.float32), mask, r00, r01, r10, r11, dtype, INTERPRETED)
    return lo.to(dtype), hi.to(dtype)


@triton.jit(do_not_specialize=["num_tokens"])  # per step: one compile serves every step
def _rotary_write_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    pos_ptr,
    table_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_centre_ptr,
    rot_ptr,
    num_tokens,
    num_slots,
    max_positions,
    stride_sb,
    stride_st,
    stride_sh,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_vb,
    stride_vs,
    stride_vc,
    stride_vd,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_BLOCK_H: tl.constexpr,
    Q_CHUNKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
    CENTRE_K: tl.constexpr,
    ROTATE: tl.constexpr,
    VALUE_RUN: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (token, chunk): chunks ``< Q_CHUNKS`` rotate BLOCK_H query heads into q_out; the
    others rotate KV_BLOCK_H KV heads of K and store them with the same heads of V at the
    token's slot.

    The position is clamped into the table and a slot outside [0, num_slots) (the -1 of a
    padding token, or a corrupt id) writes no K/V, so nothing outside the table, the inputs,
    q_out and the given slots is ever read or written. The K cache's strides are (stride_cb,
    stride_ct, stride_ch, 1); V has its own, contiguous or token-major
    (:mod:`attention.value_layout`). TOKEN_SCALES (an int8 cache): each (token, KV head) row
    gets its own fp16 scale, stored at ``k_scale_ptr`` / ``v_scale_ptr`` + block * stride_sb
    + offset * stride_st + head * stride_sh, as the cache write stores it. CENTRE_K: the
    rotated K, rounded to the input's dtype, less ``k_centre`` (fp32 [NUM_KV_HEADS, 2 * HALF])
    is what the int8 cache quantizes, as the cache write does. ROTATE: K (after rotary) and V
    are multiplied by the [2 HALF, 2 HALF] matrix at ``rot_ptr`` (the input's dtype) before
    they are stored or quantized (:func:`_to_basis`). VALUE_RUN (> 0: a token-major V): V of
    tokens in runs of VALUE_RUN (:mod:`.value_runs`) is left to :func:`_value_runs_kernel`.
    """
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    j = tl.arange(0, HALF_PAD)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t), 0), max_positions - 1)
    row = table_ptr + pos * (2 * HALF)
    cos = tl.load(row + j, mask=j < HALF)
    sin = tl.load(row + HALF + j, mask=j < HALF)
    # The two branches share no variable names: Triton requires a name assigned in both
    # branches to have one type in both, and K leaves as the cache dtype.
    if chunk < Q_CHUNKS:
        h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (h[:, None] < NUM_HEADS) & (j[None, :] < HALF)
        q_lo, q_hi = _rotate_tile(q_ptr, t * stride_qt + h[:, None] * stride_qh, j, mask, cos, sin, HALF)
        out = q_out_ptr + t * stride_ot + h[:, None] * stride_oh + j[None, :]
        tl.store(out, q_lo.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, q_hi.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kh = (chunk - Q_CHUNKS) * KV_BLOCK_H + tl.arange(0, KV_BLOCK_H)
        slot = tl.load(slot_ptr + t)
        # An invalid slot shrinks the head range to nothing (a scalar select: the interpreter
        # mistypes scalar & tensor).
        heads = tl.where((slot >= 0) & (slot < num_slots), NUM_KV_HEADS, 0)
        kh_mask = kh < heads
        kv_mask = kh_mask[:, None] & (j[None, :] < HALF)
        if VALUE_RUN > 0:  # a run's V is stored by _value_runs_kernel
            v_heads = tl.where(_in_value_run(slot_ptr, t, slot, num_tokens, num_slots, VALUE_RUN), 0, heads)
        else:
            v_heads = heads
        v_head_mask = kh < v_heads
        v_mask = v_head_mask[:, None] & (j[None, :] < HALF)
        k_lo, k_hi = _rotate_tile(k_ptr, t * stride_kt + kh[:, None] * stride_kh, j, kv_mask, cos, sin, HALF)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kh[:, None] * stride_ch + j[None, :]
        v_dst = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs + kh[:, None] * stride_vc
        v_dst = v_dst + j[None, :] * stride_vd
        v_src = v_ptr + t * stride_vt + kh[:, None] * stride_vh + j[None, :]
        v_lo = tl.load(v_src, mask=kv_mask)
        v_hi = tl.load(v_src + HALF, mask=kv_mask)
        dtype = k_cache_ptr.dtype.element_ty
        if ROTATE:  # K and V into the cache's basis, rounded to the input's dtype
            k_in_dtype = k_ptr.dtype.element_ty
            r00 = _basis_quarter(rot_ptr, 0, 0, HALF, HALF_PAD)  # the matrix, loaded once for K and V
            r01 = _basis_quarter(rot_ptr, 0, HALF, HALF, HALF_PAD)
            r10 = _basis_quarter(rot_ptr, HALF, 0, HALF, HALF_PAD)
            r11 = _basis_quarter(rot_ptr, HALF, HALF, HALF, HALF_PAD)
            k_lo, k_hi = _to_basis(k_lo, k_hi, kv_mask, r00, r01, r10, r11, k_in_dtype, INTERPRETED)
            v_lo, v_hi = _value_to_basis(v_lo, v_hi, kv_mask, r00, r01, r10, r11, k_in_dtype, INTERPRETED)
        s_dst = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_st + kh * stride_sh  # int8 scales
        if TOKEN_SCALES:
            # K as the composed boundary stores it: rotated, rounded to the input's dtype, quantized.
            k_in = k_ptr.dtype.element_ty
            k_lo = _as_input_dtype(k_lo, k_in, INTERPRETED)
            k_hi = _as_input_dtype(k_hi, k_in, INTERPRETED)
            if CENTRE_K:
                centre = k_centre_ptr + kh[:, None] * (2 * HALF) + j[None, :]
                k_lo = k_lo - tl.load(centre, mask=kv_mask, other=0.0)
                k_hi = k_hi - tl.load(centre + HALF, mask=kv_mask, other=0.0)
            _store_int8_halves(k_lo, k_hi, kv_mask, k_cache_ptr, dst, 1, k_scale_ptr, s_dst, kh_mask, HALF)
        else:
            if QUANTIZE:
                k_lo_out = _quantize(k_lo, k_scale_ptr, kh, kh_mask, dtype, INTERPRETED)
                k_hi_out = _quantize(k_hi, k_scale_ptr, kh, kh_mask, dtype, INTERPRETED)
            else:
                k_lo_out = k_lo.to(dtype)
                k_hi_out = k_hi.to(dtype)
            tl.store(k_cache_ptr + dst, k_lo_out, mask=kv_mask)
            tl.store(k_cache_ptr + dst + HALF, k_hi_out, mask=kv_mask)
        _store_values(
            v_lo, v_hi, v_mask, v_head_mask, kh, v_cache_ptr, v_dst, stride_vd, v_scale_ptr, s_dst,
            HALF, QUANTIZE, TOKEN_SCALES, INTERPRETED,
        )  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens"])
def _value_runs_kernel(  # type: ignore[no-untyped-def]
    v_ptr,
    v_cache_ptr,
    slot_ptr,
    v_scale_ptr,
    rot_ptr,
    num_tokens,
    num_slots,
    stride_sb,
    stride_st,
    stride_sh,
    stride_vt,
    stride_vh,
    stride_vb,
    stride_vs,
    stride_vc,
    stride_vd,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    RUN: tl.constexpr,
    QUANTIZE: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
    ROTATE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (window, KV head): the run starting among tokens ``window * RUN ..``, if any
    (:func:`~.value_runs._value_run_in_window`), stores its V of that head into a token-major
    cache as :func:`_rotary_write_kernel` would token by token (the same products, scales and
    rounding), as a [tokens, head_dim] tile whose tokens are adjacent in memory. Arguments as
    there; ``stride_v*`` of the input V are ``stride_vt`` / ``stride_vh``."""
    window = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    found, lead, first = _value_run_in_window(slot_ptr, window, num_tokens, num_slots, RUN)
    g = tl.arange(0, RUN)
    j = tl.arange(0, HALF_PAD)
    g_mask = g < tl.where(found, RUN, 0)  # a scalar select, as in _rotary_write_kernel
    mask = g_mask[:, None] & (j[None, :] < HALF)
    v_src = v_ptr + (lead + g)[:, None] * stride_vt + kh * stride_vh + j[None, :]
    v_lo = tl.load(v_src, mask=mask)
    v_hi = tl.load(v_src + HALF, mask=mask)
    block = first // BLOCK_SIZE
    offset = first % BLOCK_SIZE
    v_dst = block * stride_vb + (offset + g[:, None]) * stride_vs + kh * stride_vc + j[None, :] * stride_vd
    if ROTATE:  # into the cache's basis, rounded to the input's dtype
        r00 = _basis_quarter(rot_ptr, 0, 0, HALF, HALF_PAD)
        r01 = _basis_quarter(rot_ptr, 0, HALF, HALF, HALF_PAD)
        r10 = _basis_quarter(rot_ptr, HALF, 0, HALF, HALF_PAD)
        r11 = _basis_quarter(rot_ptr, HALF, HALF, HALF, HALF_PAD)
        v_lo, v_hi = _value_to_basis(v_lo, v_hi, mask, r00, r01, r10, r11, v_ptr.dtype.element_ty, INTERPRETED)
    s_dst = block * stride_sb + (offset + g) * stride_st + kh * stride_sh  # int8 scales
    heads = kh + tl.zeros([RUN], dtype=tl.int32)
    _store_values(
        v_lo, v_hi, mask, g_mask, heads, v_cache_ptr, v_dst, stride_vd, v_scale_ptr, s_dst,
        HALF, QUANTIZE, TOKEN_SCALES, INTERPRETED,
    )  # fmt: skip


def value_runs_launched(v_cache: torch.Tensor, num_tokens: int, value_runs: bool | None) -> int:
    """Tokens per run of the runs kernel :func:`rotary_write_kv` launches for a step of
    ``num_tokens`` into ``v_cache`` with ``value_runs`` (see there); 0: none."""
    run = value_runs_for(v_cache)
    if value_runs is False or (value_runs is None and (num_tokens < run or v_cache.dtype == torch.int8)):
        return 0
    return run


def rotary_write_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_centre: torch.Tensor | None = None,
    rotation: torch.Tensor | None = None,
    value_runs: bool | None = None,
) -> torch.Tensor:
    """Rotate ``query``/``key`` at ``positions``, write rotated K and V to ``slot_mapping``'s
    slots, return the rotated query.

    query:            [num_tokens, num_heads, head_dim]; key, value [num_tokens, num_kv_heads,
                      head_dim]; one dtype, unit stride along head_dim, any other strides.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; k_cache contiguous,
                      v_cache contiguous or token-major (:mod:`attention.value_layout`).
    slot_mapping:     int64 [num_tokens]; -1 (and any id outside the cache) writes nothing.
    positions:        int64 [num_tokens]; clamped into the table.
    cos_sin:          float32 [max_positions, head_dim] (``attention.rotary.RotaryTable``).
    k_scale, v_scale: fp32 [num_kv_heads] for an fp8 cache; for an int8 cache (laid out as
                      :func:`attention.token_scales.split_block_memory` lays it out) the fp16
                      [num_blocks, block_size, num_kv_heads] per-token scales, written with
                      each row.
    k_centre:         an int8 cache's key centre, fp32 [num_kv_heads, head_dim] contiguous
                      (``LayerCache.k_centre``), or None.
    rotation:         a rotated cache's basis (:mod:`attention.kv_rotation`) in query's dtype,
                      [head_dim, head_dim] contiguous: K (after rotary) and V are stored times
                      it; the query is returned in the model's basis all the same. Not with
                      ``k_centre``.
    value_runs:       into a token-major V, write the V of runs of tokens in consecutive slots
                      (:mod:`.value_runs`: prefill rows) with a second kernel whose stores are
                      coalesced along the tokens; the bytes stored are the same either way.
                      True: wherever V's tokens are adjacent. None: there, where the step has
                      at least a run's tokens and the cache is not int8 (on an H100 the runs
                      kernel's per-token int8 scales made the Poisson run's boundary 0.44 ms
                      an iteration against 0.34; fp8 0.27 against 0.36). A caller that knows
                      the step has no prefill rows passes False (the second launch would find
                      nothing).
    Returns a new contiguous [num_tokens, num_heads, head_dim] tensor of query's dtype.
    Arguments are assumed checked by the caller (``AttentionBackend.rotary_write_kv``).
    """
    num_tokens, num_heads, head_dim = query.shape
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    half = head_dim // 2
    half_pad = next_power_of_2(max(half, 16))
    block_h = min(next_power_of_2(max(num_heads, kv_heads)), max(1, _TILE_ELEMENTS // half_pad))
    q_chunks = triton.cdiv(num_heads, block_h)
    # K/V tiles as tall as the KV heads, no taller: masked rows of a query-sized tile still
    # cost an int8 cache's row maxima (cross-thread shuffles) in the one K/V program of a token.
    kv_block_h = min(next_power_of_2(kv_heads), block_h)
    if rotation is not None:  # tl.dot takes >= 16 rows
        kv_block_h = max(16, kv_block_h)
    grid = (num_tokens, q_chunks + triton.cdiv(kv_heads, kv_block_h))
    token_scales = k_cache.dtype == torch.int8
    scale_strides = k_scale.stride() if token_scales and k_scale is not None else (0, 0, 0)
    run = value_runs_launched(v_cache, num_tokens, value_runs)
    quantize = k_scale is not None and not token_scales
    interpreted = kernels_interpreted()
    _rotary_write_kernel[grid](
        query,
        key,
        value,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        positions,
        cos_sin,
        k_scale if k_scale is not None else cos_sin,  # unused unless QUANTIZE
        v_scale if v_scale is not None else cos_sin,
        k_centre if k_centre is not None else cos_sin,  # unused unless CENTRE_K
        rotation if rotation is not None else query,  # unused unless ROTATE
        num_tokens,
        num_blocks * block_size,
        cos_sin.shape[0],
        *scale_strides,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=kv_heads,
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_H=block_h,
        KV_BLOCK_H=kv_block_h,
        Q_CHUNKS=q_chunks,
        BLOCK_SIZE=block_size,
        QUANTIZE=quantize,
        TOKEN_SCALES=token_scales,
        CENTRE_K=token_scales and k_centre is not None,
        ROTATE=rotation is not None,
        VALUE_RUN=run,
        INTERPRETED=interpreted,
        num_warps=4,
    )
    if run:
        _value_runs_kernel[(triton.cdiv(num_tokens, run), kv_heads)](
            value, v_cache, slot_mapping,
            v_scale if v_scale is not None else cos_sin,  # unused unless QUANTIZE or TOKEN_SCALES
            rotation if rotation is not None else query,  # unused unless ROTATE
            num_tokens, num_blocks * block_size, *scale_strides, value.stride(0), value.stride(1), *v_cache.stride(),
            HALF=half, HALF_PAD=half_pad, BLOCK_SIZE=block_size, RUN=run, QUANTIZE=quantize,
            TOKEN_SCALES=token_scales, ROTATE=rotation is not None, INTERPRETED=interpreted, num_warps=4,
        )  # fmt: skip
    return q_out
