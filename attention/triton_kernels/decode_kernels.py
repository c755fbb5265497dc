"""Triton source of the paged decode kernels (the launcher is :mod:`.decode`).

Program (kv_head, i) of :func:`decode_items_kernel` takes item i of the step's schedule
(:mod:`.decode_schedule`): one chunk ``[kv_start, kv_end)`` of one decode row, for all query
heads of one KV group and all of the row's new tokens (up to 8, for verifying draft tokens;
the tokens x heads padded to >= 16 rows so ``tl.dot`` runs on tensor cores; each K/V token is
read once per KV head, not once per query head or new token). A row with one chunk writes
its output directly; a row with several writes an fp32 partial output and log-sum-exp per
chunk, merged either by :func:`decode_combine_kernel` or, with FUSED_COMBINE, by the last of
the row's chunk programs to finish (an int32 counter per (row, kv_head), incremented with an
acq_rel atomic after the partial is stored and reset to 0 by the merging program).

Scalar conditions join tensor masks through ``tl.where(cond, mask, False)``: the interpreter
(triton 3.9) rejects ``mask & scalar`` as a load mask ("mask has unsupported dtype").

Memory safety holds for any metadata: item indices, table rows, query tokens, partial slots
and counter rows are range-checked; every block id read from the table is checked against
[0, num_blocks) and an out-of-range id masks its K/V off (never dereferenced, and left out of
the softmax; a token-major V tile is read unmasked from block 0 instead, in the cache, and
its values made finite before they meet p = 0); table columns are clamped to the table width and kv ranges to
[0, table_width * block_size].
"""

from __future__ import annotations

import triton
import triton.language as tl

from attention.triton_kernels.paging import (
    finite_e4m3_operand,
    finite_operand,
    int8_values,
    soft_cap,
    tile_columns,
    tile_mask,
    tile_token_offsets,
    to_f16_operand,
    token_major_offsets,
    token_scale_offsets,
)

__all__ = ["decode_combine_kernel", "decode_items_kernel"]

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _tile_pages(  # type: ignore[no-untyped-def]
    table_ptr,
    n0,
    offs_n,
    kv_end,
    table_width,
    num_blocks,
    row_ok,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(int64 block ids, validity) of the tile of tokens ``n0 + offs_n`` (n0 a multiple of
    BLOCK_N) of a row attended up to ``kv_end``.

    Tile inside one block (BLOCK_SIZE % BLOCK_N == 0): one id, of the block holding token
    ``min(n0, kv_end - 1)``; the clamp lets the loop prefetch one tile past its end (it
    rereads the last entry). Otherwise one id per token; lanes at or past kv_end read nothing.
    Ids outside [0, num_blocks), and every id of a row whose table row is out of range, come
    back invalid with id 0, so the caller's K/V loads can mask them off.
    """
    if BLOCK_SIZE % BLOCK_N == 0:
        col = tl.minimum(n0, kv_end - 1) // BLOCK_SIZE
        col = tl.maximum(tl.minimum(col, table_width - 1), 0)
        page = tl.load(table_ptr + col, mask=row_ok, other=-1)
    else:
        n = n0 + offs_n
        col = tl.maximum(tl.minimum(tile_columns(n0, offs_n, BLOCK_SIZE, BLOCK_N), table_width - 1), 0)
        page = tl.load(table_ptr + col, mask=tl.where(row_ok, n < kv_end, False), other=-1)
    ok = (page >= 0) & (page < num_blocks)
    return tl.where(ok, page, 0).to(tl.int64), ok


@triton.jit
def _tile_token_scales(  # type: ignore[no-untyped-def]
    k_scale_ptr, v_scale_ptr, pages, ok, n0, offs_n, kv_start, kv_end, kvh, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_STRIDE: tl.constexpr,
):  # fmt: skip
    """An int8 cache's fp16 per-token K and V scales of KV head ``kvh`` for the tile of tokens
    ``n0 + offs_n`` whose block ids are ``pages`` (``ok``: they are usable), as fp32 [BLOCK_N]
    each; 0 for tokens outside ``[kv_start, kv_end)``, whose stale (NaN) scales are never read."""
    n = n0 + offs_n
    valid = tl.where(ok, (n >= kv_start) & (n < kv_end), False)
    off = token_scale_offsets(pages, n0, offs_n, kvh, BLOCK_SIZE, BLOCK_N, BLOCK_STRIDE)
    ks = tl.load(k_scale_ptr + off, mask=valid, other=0.0).to(tl.float32)
    vs = tl.load(v_scale_ptr + off, mask=valid, other=0.0).to(tl.float32)
    return ks, vs


@triton.jit
def _softmax_step(  # type: ignore[no-untyped-def]
    s, v, m_i, l_i, acc, v_cols, DOT_PRECISION: tl.constexpr, V_COLS: tl.constexpr
):
    """Fold one tile into the running softmax (FlashAttention-2 recurrence, log2 domain).

    s: fp32 [M, N] scores already scaled by softmax_scale * log2(e), -inf where masked.
    V_COLS (an int8 cache): P's columns are multiplied by ``v_cols``, fp32 [N] per-token V
    scales (0 for tokens not seen), before P meets the int8 values; else ``v_cols`` is unused.
    Unlike the prefill helper, a tile may be entirely masked (out-of-range block ids): a row
    whose running max is still -inf subtracts 0 instead, so it stays at l = 0, acc = 0
    rather than turning NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_COLS:
        p = p * v_cols[None, :]
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_head(  # type: ignore[no-untyped-def]
    part_o_ptr,
    part_lse_ptr,
    sinks_ptr,
    first,
    count,
    head,
    dst_ptr,
    store_ok,
    num_partial_slots,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    MERGE_CHUNKS: tl.constexpr,
    SINKS: tl.constexpr,
):
    """out[head] = sum_c 2^lse_c o_c / sum_c 2^lse_c over partial slots first .. first+count-1
    (with SINKS, the denominator gains 2^sink, the head's sink logit in log2 units).

    part_o: fp32 [num_partial_slots, NUM_HEADS, HEAD_DIM]; part_lse: fp32
    [num_partial_slots, NUM_HEADS] (log2 domain, -inf for an empty chunk). Chunks are read
    MERGE_CHUNKS at a time, through L2 (".cg"): in the fused combine they were written by
    other programs of this launch, which this SM's L1 does not see. The running max and sum
    are kept as [D_PAD] vectors of equal lanes, so the loop carries tensors only.
    """
    c = tl.arange(0, MERGE_CHUNKS)
    d = tl.arange(0, D_PAD)
    m_run = tl.full([D_PAD], float("-inf"), tl.float32)
    l_run = tl.zeros([D_PAD], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    n = tl.minimum(count, num_partial_slots)  # bounds the loop whatever the metadata says
    for c0 in range(0, n, MERGE_CHUNKS):
        slot = first + c0 + c
        ok = (c0 + c < n) & (slot >= 0) & (slot < num_partial_slots)
        idx = slot.to(tl.int64) * NUM_HEADS + head
        lse = tl.load(part_lse_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            part_o_ptr + idx[:, None] * HEAD_DIM + d[None, :],
            mask=tile_mask(ok, d, HEAD_DIM, D_PAD),
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - tl.max(m_safe, 0))  # masked chunks: 2^-inf = 0
        alpha = tl.exp2(m_run - m_safe)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        l_run = l_run * alpha + tl.sum(w, 0)
        m_run = m_new
    if SINKS:
        sink = tl.load(sinks_ptr + head) * _LOG2E
        m_f = tl.maximum(m_run, sink)
        alpha = tl.exp2(m_run - m_f)
        acc = acc * alpha
        l_run = l_run * alpha + tl.exp2(sink - m_f)
    result = acc / tl.where(l_run > 0.0, l_run, 1.0)
    tl.store(dst_ptr + d, result.to(dst_ptr.dtype.element_ty), mask=tl.where(store_ok, d < HEAD_DIM, False))


# Per-step sizes are not specialised on: one compiled kernel serves every step and bucket.
@triton.jit(
    do_not_specialize=[
        "num_item_slots",
        "num_table_rows",
        "table_width",
        "num_blocks",
        "num_q_tokens",
        "num_partial_slots",
        "num_counter_rows",
        "stride_bt",
        "window",
    ]
)
def decode_items_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    tree_ptr,
    block_tables_ptr,
    items_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    counters_ptr,
    qk_scale,
    softcap,
    window,
    num_item_slots,
    num_table_rows,
    table_width,
    num_blocks,
    num_q_tokens,
    num_partial_slots,
    num_counter_rows,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    Q_PAD: tl.constexpr,
    M_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
    KV_SCALED: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
    F16_DOTS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    MERGE_CHUNKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    TREE: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
):
    """Program (kv_head, i): item i of int32 items [num_item_slots, 10] = (d, kv_start,
    kv_end, partial_slot, table_row, q_token, num_chunks, first_partial, q_len, row_end);
    d < 0 is padding.

    The tile's M_PAD rows are (new token t, query head g of the group): row m = t * G_PAD + g,
    for t < Q_PAD (the launch's tokens per row) and g < G_PAD (the group, padded to a power of
    two); M_PAD >= 16 so ``tl.dot`` runs on tensor cores. A row's q_len new tokens are query
    tokens q_token .. q_token + q_len - 1 at positions row_end - q_len .. row_end - 1; token t
    sees keys up to its own position (with TREE, the keys before the new tokens and the new
    tokens j whose bit j is set in ``tree_ptr[q_token + t]``, an int32 ancestor mask), and
    with a ``window`` > 0 only the last ``window`` positions up to its own. With Q_PAD = 1
    none of these masks is compiled: the item's range is the row's.

    K/V caches: [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM], contiguous within a block,
    blocks BLOCK_STRIDE elements apart (compile-time strides). KV_SCALED (an fp8 cache): K
    and V are converted to the query's dtype and dequantised with per-KV-head fp32 scales,
    k_scale folded into the score scale and v_scale applied to the output (both constant
    over the head, so the same as scaling every element). TOKEN_SCALES (an int8 cache,
    :mod:`attention.token_scales`; V token-major): K and V are converted to the query's
    dtype (exact: |v| <= 127); ``k_scale_ptr`` / ``v_scale_ptr`` are the fp16 per-token
    scales (``LayerCache.k_scale``), read per tile as a [BLOCK_N] vector masked to the valid
    tokens (other=0, so a stale NaN scale past a row's end is never read); the scores are
    multiplied by the K scales, P's columns by the V scales before the P @ V product.
    F16_DOTS (an fp8 cache, 16-bit queries): both dots take fp16 operands
    (``paging.f16_dots_for``), else the query's dtype. SOFTCAP: scores are capped,
    ``softcap * tanh(s / softcap)`` with ``softcap`` in the same log2 units as ``qk_scale``.
    SINKS: each head's learned sink logit (``sinks_ptr``, natural units of the scaled scores)
    joins the softmax's denominator once: here for a row of one chunk, at the merge for a
    split row. V_TOKEN_MAJOR: the V cache is token-major (:mod:`attention.value_layout`);
    its tiles load as [D_PAD, BLOCK_N], unmasked along the tokens, and are made finite
    (``paging.finite_e4m3_operand`` for float8_e4m3fn, ``finite_operand`` otherwise; not for int8,
    whose values are all finite).
    """
    kvh = tl.program_id(0)
    i = tl.program_id(1)
    if i >= num_item_slots:
        return
    # All fields first: they share one or two 32-byte sectors, so this is one memory latency.
    item = items_ptr + i.to(tl.int64) * 10
    d = tl.load(item)
    kv_start = tl.load(item + 1)
    kv_end = tl.load(item + 2)
    slot = tl.load(item + 3)
    table_row = tl.load(item + 4)
    q_token = tl.load(item + 5)
    num_chunks = tl.load(item + 6)
    first_partial = tl.load(item + 7)
    q_len = tl.load(item + 8)
    row_end = tl.load(item + 9)
    if d < 0:
        return  # padding of a fixed (CUDA-graph) grid

    kv_start = tl.maximum(kv_start, 0)
    kv_end = tl.minimum(kv_end, table_width * BLOCK_SIZE)
    row_ok = (table_row >= 0) & (table_row < num_table_rows)
    table_ptr = block_tables_ptr + tl.where(row_ok, table_row, 0).to(tl.int64) * stride_bt

    m = tl.arange(0, M_PAD)
    t = m // G_PAD
    g = m % G_PAD
    heads = kvh * GROUP + g
    token = q_token + t
    q_ok = (t < Q_PAD) & (t < q_len) & (g < GROUP) & (token >= 0) & (token < num_q_tokens)
    token64 = tl.where(q_ok, token, 0).to(tl.int64)
    dd = tl.arange(0, D_PAD)
    q_mask = tile_mask(q_ok, dd, HEAD_DIM, D_PAD)
    q_off = token64[:, None] * stride_qt + heads[:, None].to(tl.int64) * stride_qh + dd[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    if F16_DOTS:
        q = to_f16_operand(q)
    elif UPCAST:
        q = q.to(tl.float32)
    scale = qk_scale
    if KV_SCALED:
        scale = qk_scale * tl.load(k_scale_ptr + kvh)
    if Q_PAD > 1:
        first_new = row_end - q_len  # position of the row's first new token
        limit = first_new + t  # token t's own position: the last key it may see
        if TREE:  # noqa: SIM108 (a compile-time branch)
            ancestors = tl.load(tree_ptr + token64, mask=q_ok, other=0)
        else:  # causal: the chain, token t sees new tokens 0..t (the tree test below is faster)
            ancestors = (2 << t) - 1

    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D_PAD], tl.float32)
    head_off = kvh * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    first = (kv_start // BLOCK_N) * BLOCK_N  # tiles stay aligned (one table read per tile)
    pages, ok = _tile_pages(table_ptr, first, offs_n, kv_end, table_width, num_blocks, row_ok, BLOCK_SIZE, BLOCK_N)
    k_cols = qk_scale  # TOKEN_SCALES: this tile's K and V scales, loaded one tile ahead
    v_cols = qk_scale
    if TOKEN_SCALES:
        k_cols, v_cols = _tile_token_scales(
            k_scale_ptr, v_scale_ptr, pages, ok, first, offs_n, kv_start, kv_end, kvh, BLOCK_SIZE, BLOCK_N,
            BLOCK_STRIDE,
        )  # fmt: skip
    for n0 in range(first, kv_end, BLOCK_N):
        n = n0 + offs_n
        valid = tl.where(ok, (n >= kv_start) & (n < kv_end), False)
        tok = tile_token_offsets(pages, n0, offs_n, BLOCK_SIZE, BLOCK_N, NUM_KV_HEADS * HEAD_DIM, BLOCK_STRIDE)
        if V_TOKEN_MAJOR:
            vt_off = token_major_offsets(pages, n0, offs_n, head_off + dd, BLOCK_SIZE, BLOCK_N, BLOCK_STRIDE)
        # Next tile's ids now: loop-carried, so the pipeliner multi-buffers the K/V copies.
        pages, ok = _tile_pages(
            table_ptr, n0 + BLOCK_N, offs_n, kv_end, table_width, num_blocks, row_ok, BLOCK_SIZE, BLOCK_N
        )
        tile_k_cols, tile_v_cols = k_cols, v_cols
        if TOKEN_SCALES:  # the next tile's scales now, so their latency hides behind this tile's dots
            k_cols, v_cols = _tile_token_scales(
                k_scale_ptr, v_scale_ptr, pages, ok, n0 + BLOCK_N, offs_n, kv_start, kv_end, kvh, BLOCK_SIZE,
                BLOCK_N, BLOCK_STRIDE,
            )  # fmt: skip
        kv_off = tok[:, None] + head_off + dd[None, :]
        kv_mask = tile_mask(valid, dd, HEAD_DIM, D_PAD)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST or KV_SCALED or TOKEN_SCALES:  # fp8 to fp16 under F16_DOTS (q's dtype then), int8: exact
            k = k.to(q.dtype)
        if V_TOKEN_MAJOR:
            if HEAD_DIM != D_PAD:
                vt = tl.load(v_cache_ptr + vt_off, mask=(dd < HEAD_DIM)[:, None], other=0.0)
            else:
                vt = tl.load(v_cache_ptr + vt_off)
            if TOKEN_SCALES:  # int8 is finite: past the row's end p * 0 = 0
                v = tl.trans(int8_values(vt, q.dtype))
            else:
                if UPCAST or KV_SCALED:
                    vt = vt.to(q.dtype)
                # Read unmasked (16-byte loads along the tokens) inside a valid block: slots past
                # the row's end may hold NaN, which must not meet p = 0.
                if vt.dtype == tl.float16 and v_cache_ptr.dtype.element_ty == tl.float8e4nv:
                    v = tl.trans(finite_e4m3_operand(vt))  # NaN is e4m3's only non-finite value
                else:
                    v = tl.trans(finite_operand(vt))
        else:
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            if UPCAST or KV_SCALED:
                v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if TOKEN_SCALES:
            s = s * tile_k_cols[None, :]
        if SOFTCAP:
            s = soft_cap(s, softcap)
        if Q_PAD > 1:
            j = n - first_new  # index among the new tokens (< 0: a key before them)
            bit = (ancestors[:, None] >> tl.maximum(j, 0)[None, :]) & 1
            seen = (j[None, :] < 0) | ((bit != 0) & (j[None, :] < q_len))
            if window > 0:
                seen = seen & (n[None, :] > limit[:, None] - window)
            s = tl.where(valid[None, :] & seen, s, float("-inf"))
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, tile_v_cols, DOT_PRECISION, TOKEN_SCALES)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_SCALED:
        o = o * tl.load(v_scale_ptr + kvh)
    if slot < 0:
        if SINKS:  # the whole row is here: the sink term joins this denominator
            sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0) * _LOG2E
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_f)
            o = acc * (alpha / (l_i * alpha + tl.exp2(sink - m_f)))[:, None]
            if KV_SCALED:
                o = o * tl.load(v_scale_ptr + kvh)
        dst = out_ptr + token64[:, None] * stride_ot + heads[:, None].to(tl.int64) * stride_oh + dd[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Token t of this row keeps its chunks' partials at slot + t * num_chunks.
        token_slot = slot + t * num_chunks  # garbage chunk counts may wrap it negative: checked
        slot_ok = (t < q_len) & (g < GROUP) & (token_slot >= 0) & (token_slot < num_partial_slots)
        part = token_slot.to(tl.int64) * NUM_HEADS + heads
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + dd[None, :], o, mask=tile_mask(slot_ok, dd, HEAD_DIM, D_PAD))
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=slot_ok)
        if FUSED_COMBINE:  # noqa: SIM102 (a compile-time branch; the inner test is a runtime one)
            if d < num_counter_rows:
                # Every thread's partial stores precede the release below (the atomic runs
                # on one thread), so the merging program sees them.
                tl.debug_barrier()
                counter = counters_ptr + d.to(tl.int64) * NUM_KV_HEADS + kvh
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == num_chunks - 1:
                    tl.debug_barrier()
                    for tq in range(Q_PAD):
                        tq_token = q_token + tq
                        tq_ok = (tq < q_len) & (tq_token >= 0) & (tq_token < num_q_tokens)
                        tq64 = tl.where(tq_ok, tq_token, 0).to(tl.int64)
                        for gi in range(GROUP):
                            head = kvh * GROUP + gi
                            _merge_head(
                                part_o_ptr,
                                part_lse_ptr,
                                sinks_ptr,
                                first_partial + tq * num_chunks,
                                tl.where(tq_ok, num_chunks, 0),  # a padding token reads nothing
                                head,
                                out_ptr + tq64 * stride_ot + head.to(tl.int64) * stride_oh,
                                tq_ok,
                                num_partial_slots,
                                NUM_HEADS,
                                HEAD_DIM,
                                D_PAD,
                                MERGE_CHUNKS,
                                SINKS,
                            )
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit(do_not_specialize=["num_row_slots", "num_q_tokens", "num_partial_slots"])
def decode_combine_kernel(  # type: ignore[no-untyped-def]
    rows_ptr,
    part_o_ptr,
    part_lse_ptr,
    sinks_ptr,
    out_ptr,
    num_row_slots,
    num_q_tokens,
    num_partial_slots,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    MERGE_CHUNKS: tl.constexpr,
    SINKS: tl.constexpr,
    Q_PAD: tl.constexpr,
):
    """Program (head, r): merge the partials of decode row r for one query head, from int32
    rows [num_row_slots, 5] = (table_row, q_token, num_chunks, first_partial, q_len), each of
    the row's new tokens t from its slots first_partial + t * num_chunks onwards. Rows with
    one chunk (written directly) and padding rows (num_chunks 0) exit at once."""
    h = tl.program_id(0)
    r = tl.program_id(1)
    if r >= num_row_slots:
        return
    row = rows_ptr + r.to(tl.int64) * 5
    q_token = tl.load(row + 1)
    num_chunks = tl.load(row + 2)
    first_partial = tl.load(row + 3)
    q_len = tl.load(row + 4)
    if num_chunks <= 1:
        return
    for t in range(Q_PAD):
        token = q_token + t
        q_ok = (t < q_len) & (token >= 0) & (token < num_q_tokens)
        token64 = tl.where(q_ok, token, 0).to(tl.int64)
        dst = out_ptr + token64 * stride_ot + h.to(tl.int64) * stride_oh
        _merge_head(
            part_o_ptr,
            part_lse_ptr,
            sinks_ptr,
            first_partial + t * num_chunks,
            tl.where(q_ok, num_chunks, 0),  # tokens past the row's q_len read nothing
            h,
            dst,
            q_ok,
            num_partial_slots,
            NUM_HEADS,
            HEAD_DIM,
            D_PAD,
            MERGE_CHUNKS,
            SINKS,
        )
