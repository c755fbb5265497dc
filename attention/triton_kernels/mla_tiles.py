"""What the MLA decode kernels share (the split and the balanced schedules,
:mod:`attention.triton_kernels.mla_decode` and :mod:`attention.triton_kernels.mla_balanced`):
the inner loop, one tile of query heads against a run of a token's latents with an online
softmax; the stores of its result (a partial output, or a whole token's normalized output);
and the merge's steps (fold a partial output in, store the result).

A latent is ``D = R + E`` values (``R`` = kv_lora_rank, the compressed K/V; ``E`` =
qk_rope_head_dim); the cache is ``[num_blocks, BLOCK_SIZE, 1, D]``. Latent ``n`` of a row
lives in block ``table_row[n // BLOCK_SIZE]`` at offset ``n % BLOCK_SIZE``. Block ids outside
``[0, num_blocks)`` mask their latents off (never dereferenced, and out of the softmax), and
table columns are clamped to the table width, so any table is memory-safe.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attention.triton_kernels.paging import to_f16_operand

__all__ = [
    "attend_latents",
    "fold_partial",
    "load_queries",
    "store_merged",
    "store_normalized",
    "store_partial",
    "store_tail",
    "token_extent",
]


@triton.jit
def token_extent(rows_ptr, lens_ptr, t, num_rows, table_width, BLOCK_SIZE: tl.constexpr):  # type: ignore[no-untyped-def]
    """Query token ``t``'s table row (0 for a row outside ``[0, num_rows)``) and the latents it
    sees: its length clamped to ``[0, table_width * BLOCK_SIZE]``, 0 without a row."""
    row = tl.load(rows_ptr + t)
    row_ok = (row >= 0) & (row < num_rows)
    seq_len = tl.minimum(tl.maximum(tl.load(lens_ptr + t), 0), table_width * BLOCK_SIZE)
    return tl.where(row_ok, row, 0), tl.where(row_ok, seq_len, 0)


@triton.jit
def load_queries(  # type: ignore[no-untyped-def]
    q_ptr, t, offs_h, head_ok, stride_qt, stride_qh,
    R: tl.constexpr, E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr, F16_DOTS: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s queries of heads ``offs_h``: ``q_lat`` [BLOCK_H, BLOCK_R] and ``q_pe``
    [BLOCK_H, BLOCK_E] (zeros past R, E and outside ``head_ok``), as the dots take them: fp16
    for an fp8 latent's fp16 dots (``paging.f16_dots_for``), fp32 under ``UPCAST``."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_e = tl.arange(0, BLOCK_E)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h.to(tl.int64)[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=head_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    q_pe = tl.load(q_row + R + offs_e[None, :], mask=head_ok[:, None] & (offs_e[None, :] < E), other=0.0)
    if F16_DOTS:
        q_lat, q_pe = to_f16_operand(q_lat), to_f16_operand(q_pe)
    elif UPCAST:
        q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
    return q_lat, q_pe


@triton.jit
def attend_latents(  # type: ignore[no-untyped-def]
    q_lat,  # [BLOCK_H, BLOCK_R]: the heads' W_UK^T q_nope (zeros past R)
    q_pe,  # [BLOCK_H, BLOCK_E]: their rotary part (zeros past E)
    cache_ptr,
    table_row,  # pointer to the row's block table entries
    start,  # first latent, a multiple of BLOCK_N (negative: 0)
    end,  # one past the last latent (latents of a row: [0, seq_len))
    num_blocks,
    table_width,
    scale_log2,  # softmax scale times log2(e) (times an fp8 latent's scale)
    R: tl.constexpr,
    E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CONVERT: tl.constexpr,  # latents converted to q_lat's dtype before the dots
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the heads over latents ``[start, end)``: returns the running max m
    (log2 domain, [BLOCK_H]; -inf where nothing was seen), the sum l ([BLOCK_H]) and the
    unnormalized output ``sum_n exp2(s_n - m) * latent_n[:R]`` ([BLOCK_H, BLOCK_R], fp32)."""
    D: tl.constexpr = R + E
    offs_r = tl.arange(0, BLOCK_R)
    offs_e = tl.arange(0, BLOCK_E)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    start = tl.maximum(start, 0)  # (a start that overflowed int32 reads from the row's first tile)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        in_row = n < end
        if BLOCK_SIZE % BLOCK_N == 0:
            # The tile lies in one block (n0 is a multiple of BLOCK_N): one table entry, and
            # its latents are one contiguous run of BLOCK_N * D values (wide loads).
            col = tl.maximum(tl.minimum(n0 // BLOCK_SIZE, table_width - 1), 0)
            page = tl.load(table_row + col)
            page_ok = (page >= 0) & (page < num_blocks)
            ok = tl.where(page_ok, in_row, False)  # (the interpreter takes no "mask & scalar")
            first = tl.where(page_ok, page, 0).to(tl.int64) * BLOCK_SIZE + (n0 % BLOCK_SIZE)
            lat_ptr = cache_ptr + first * D + offs_n[:, None] * D
        else:
            col = tl.maximum(tl.minimum(n // BLOCK_SIZE, table_width - 1), 0)
            page = tl.load(table_row + col, mask=in_row, other=-1)
            ok = in_row & (page >= 0) & (page < num_blocks)
            slot = tl.where(ok, page, 0).to(tl.int64) * BLOCK_SIZE + (n % BLOCK_SIZE)
            lat_ptr = cache_ptr + slot[:, None] * D
        c = tl.load(lat_ptr + offs_r[None, :], mask=ok[:, None] & (offs_r[None, :] < R), other=0.0)
        pe = tl.load(lat_ptr + R + offs_e[None, :], mask=ok[:, None] & (offs_e[None, :] < E), other=0.0)
        if CONVERT:
            c, pe = c.to(q_lat.dtype), pe.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def store_partial(acc_ptr, ml_ptr, base, keep, acc, m_i, l_i, R: tl.constexpr, BLOCK_R: tl.constexpr):  # type: ignore[no-untyped-def]
    """A partial output: ``acc`` [BLOCK_H, BLOCK_R] (its first R channels), ``m_i`` and ``l_i``
    [BLOCK_H] into the slots ``base`` (int64 [BLOCK_H]: slot * heads + head) where ``keep``.
    Into a float16 ``acc_ptr`` each head's output and sum are scaled by ``2**-k`` and its max
    (log2 domain) raised by ``k``, ``k`` the least integer putting the head's largest channel
    within 1: :func:`fold_partial`'s sums are the same, and the channels keep fp16's 11
    significant bits whatever their size (as the Hopper kernel's, ``mla_hopper_stores``)."""
    offs_r = tl.arange(0, BLOCK_R)
    if acc_ptr.dtype.element_ty == tl.float16:
        most = tl.max(tl.abs(acc), 1)
        k = tl.where(most > 0, tl.ceil(tl.log2(most)), 0.0)
        scale = tl.exp2(-k)
        acc = acc * scale[:, None]
        m_i = m_i + k
        l_i = l_i * scale
    tl.store(acc_ptr + base[:, None] * R + offs_r[None, :], acc.to(acc_ptr.dtype.element_ty),
             mask=keep[:, None] & (offs_r[None, :] < R))  # fmt: skip
    tl.store(ml_ptr + base * 2, m_i, mask=keep)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=keep)


@triton.jit
def fold_partial(acc_ptr, ml_ptr, base, m_run, l_run, acc, R: tl.constexpr, BLOCK_R: tl.constexpr):  # type: ignore[no-untyped-def]
    """A merge's step: the partial output in slot ``base`` (``acc_ptr[base * R : + R]``, its
    max and sum at ``ml_ptr[2 * base]``) folded into the running ``m_run``, ``l_run`` and
    ``acc`` ([BLOCK_R]) by log-sum-exp; returns the three."""
    offs_r = tl.arange(0, BLOCK_R)
    m_s = tl.load(ml_ptr + base * 2)
    l_s = tl.load(ml_ptr + base * 2 + 1)
    a_s = tl.load(acc_ptr + base * R + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
    m_new = tl.maximum(m_run, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    w_run = tl.exp2(m_run - m_safe)
    w_s = tl.exp2(m_s - m_safe)
    return m_new, l_run * w_run + l_s * w_s, acc * w_run + a_s * w_s


@triton.jit
def store_merged(  # type: ignore[no-untyped-def]
    out_ptr, token, head, stride_ot, stride_oh, acc, tail,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):  # fmt: skip
    """A merge's last step: one (token, head)'s output ``acc`` ([BLOCK_R], the first R
    channels) into ``out`` in its dtype, then zeros into the ``tail`` channels after them
    (``BLOCK_TAIL``: a power of two >= tail, 0 for none)."""
    out = out_ptr + token.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    offs_r = tl.arange(0, BLOCK_R)
    tl.store(out + offs_r, acc.to(out_ptr.dtype.element_ty), mask=offs_r < R)
    store_tail(out_ptr, token, head, stride_ot, stride_oh, tail, R, BLOCK_TAIL)


@triton.jit
def store_tail(  # type: ignore[no-untyped-def]
    out_ptr, token, head, stride_ot, stride_oh, tail, R: tl.constexpr, BLOCK_TAIL: tl.constexpr
):  # fmt: skip
    """Zeros into one (token, head)'s ``tail`` channels of ``out`` after the first R
    (``BLOCK_TAIL``: a power of two >= tail, 0 for none)."""
    if BLOCK_TAIL > 0:
        out = out_ptr + token.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        offs_t = tl.arange(0, BLOCK_TAIL)
        zeros = tl.zeros([BLOCK_TAIL], tl.float32)
        tl.store(out + R + offs_t, zeros.to(out_ptr.dtype.element_ty), mask=offs_t < tail)


@triton.jit
def store_normalized(  # type: ignore[no-untyped-def]
    out_ptr, token, offs_h, head_ok, stride_ot, stride_oh, acc, l_i, R: tl.constexpr, BLOCK_R: tl.constexpr
):  # fmt: skip
    """A token attended whole by one program: ``acc / l_i`` ([BLOCK_H, BLOCK_R], [BLOCK_H];
    zeros where nothing was visible) into its first R channels of heads ``offs_h`` (where
    ``head_ok``) of ``out``, in its dtype."""
    offs_r = tl.arange(0, BLOCK_R)
    rows = out_ptr + token.to(tl.int64) * stride_ot + offs_h.to(tl.int64)[:, None] * stride_oh
    value = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(rows + offs_r[None, :], value.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (offs_r[None, :] < R))
