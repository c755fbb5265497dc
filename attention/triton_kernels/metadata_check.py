"""The metadata check of :mod:`attention.metadata_check` as one Triton kernel (no host sync)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.metadata import AttentionMetadata

__all__ = ["check_metadata"]

_CHUNK = 128  # table columns / tokens one program looks at per loop step


@triton.jit
def _reported(value):  # type: ignore[no-untyped-def]
    """An int64 value as the int32 the flag holds, clamped (as the torch check reports it)."""
    return tl.minimum(tl.maximum(value, -2147483647), 2147483647).to(tl.int32)


@triton.jit
def _note(flag_ptr, code, row, index, value):  # type: ignore[no-untyped-def]
    """Record the first violation: whoever swaps the code in from 0 writes the details."""
    if tl.atomic_cas(flag_ptr, 0, code) == 0:
        tl.store(flag_ptr + 1, row)
        tl.store(flag_ptr + 2, index)
        tl.store(flag_ptr + 3, value)


@triton.jit
def _max(a, b):  # type: ignore[no-untyped-def]
    return tl.maximum(a, b)


@triton.jit
def _repair_starts(qsl_ptr, slots_ptr, flag_ptr, num_rows, num_tokens, CHUNK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Make query_start_loc non-decreasing from 0 and within [0, num_tokens] (a running
    maximum of the clamped values), so no kernel indexes query rows outside the step; then
    set slot -1 for tokens no row holds (every token, when the starts needed repair)."""
    offs = tl.arange(0, CHUNK)
    running = 0
    repaired = 0
    for r0 in range(0, num_rows + 1, CHUNK):
        idx = r0 + offs
        m = idx < num_rows + 1
        v = tl.load(qsl_ptr + idx, mask=m, other=0)
        fixed = tl.where(idx == 0, 0, tl.minimum(tl.maximum(v, 0), num_tokens))
        fixed = tl.maximum(tl.associative_scan(fixed, 0, _max), running)
        bad = m & (fixed != v)
        if tl.sum(bad.to(tl.int32), 0) > 0:
            first = tl.min(tl.where(bad, idx, num_rows + 1), 0)
            _note(flag_ptr, 2, first, first, tl.load(qsl_ptr + first))
            tl.store(qsl_ptr + idx, fixed, mask=bad)
        repaired = tl.maximum(repaired, tl.max(bad.to(tl.int32), 0))
        running = tl.max(tl.where(m, fixed, 0), 0)
    # Tokens after the last row belong to no row; once the starts needed repair, no token's
    # row is known: all of them write nothing.
    first_tok = tl.where(repaired > 0, 0, running)
    for t0 in range(first_tok, num_tokens, CHUNK):
        tok = t0 + offs
        in_t = tok < num_tokens
        slot = tl.load(slots_ptr + tok, mask=in_t, other=-1)
        stray = in_t & (slot != -1)
        if tl.sum(stray.to(tl.int32), 0) > 0:
            first_bad = tl.min(tl.where(stray, tok, num_tokens), 0)
            _note(flag_ptr, 5, num_rows, first_bad, _reported(tl.load(slots_ptr + first_bad)))
            tl.store(slots_ptr + tok, tl.full([CHUNK], -1, tl.int64), mask=stray)


# Every argument but the constexprs changes from step to step; one compiled kernel serves all.
@triton.jit(do_not_specialize=["num_blocks", "num_tokens", "window", "stride_bt", "num_rows"])
def _check_kernel(  # type: ignore[no-untyped-def]
    seq_lens_ptr,
    qsl_ptr,
    tables_ptr,
    slots_ptr,
    positions_ptr,
    flag_ptr,
    num_blocks,
    num_tokens,
    window,
    stride_bt,
    num_rows,
    WIDTH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    if i == 0:
        _repair_starts(qsl_ptr, slots_ptr, flag_ptr, num_rows, num_tokens, CHUNK)
    s = tl.load(seq_lens_ptr + i)
    bad_len = (s < 0) | (s > WIDTH * BLOCK_SIZE)
    # The table columns to check: a row's length repaired to 0 below stops none of its reads
    # by a backend that plans from the host's lengths, so they cover the length as given (the
    # whole width when that is out of range) and column 0 (a padding row's).
    table_len = tl.where(bad_len, WIDTH * BLOCK_SIZE, s)
    if bad_len:
        _note(flag_ptr, 1, i, i, s)
        tl.store(seq_lens_ptr + i, 0)
    s = tl.where(bad_len, 0, s)
    q0 = tl.load(qsl_ptr + i)
    q1 = tl.load(qsl_ptr + i + 1)
    bad_start = ((i == 0) & (q0 != 0)) | (q0 < 0) | (q1 < q0) | (q1 > num_tokens)
    if bad_start:
        _note(flag_ptr, 2, i, i, q1)
        tl.store(seq_lens_ptr + i, 0)
    # With bad starts the row's tokens are not examined (q = 0 skips the token loop).
    q = tl.where(bad_start, 0, q1 - q0)
    bad_q = (s > 0) & (q > s)
    bad_q = bad_q | ((s > 0) & (q < 1) & ~bad_start)
    if bad_q:
        _note(flag_ptr, 3, i, i, q)
        tl.store(seq_lens_ptr + i, 0)
    s = tl.where(bad_q | bad_start, 0, s)
    row = tables_ptr + i.to(tl.int64) * stride_bt
    first = 0
    if HAS_WINDOW:  # a row whose length was repaired: every column (its window is unknown)
        first = tl.where(s > 0, tl.maximum(s - q - window + 1, 0) // BLOCK_SIZE, 0)
    last = tl.maximum(tl.cdiv(table_len, BLOCK_SIZE), 1)
    offs = tl.arange(0, CHUNK)
    for c0 in range(first, last, CHUNK):
        cols = c0 + offs
        in_row = cols < last
        blocks = tl.load(row + cols, mask=in_row, other=0)
        bad = in_row & ((blocks < 0) | (blocks >= num_blocks))
        if tl.sum(bad.to(tl.int32), 0) > 0:
            col = tl.min(tl.where(bad, cols, WIDTH), 0)
            _note(flag_ptr, 4, i, col, tl.load(row + col))
            tl.store(row + cols, tl.zeros_like(blocks), mask=bad)
    tl.debug_barrier()  # the repaired entries are read back below, by other threads
    end = tl.where(bad_start, q0, q1)
    for t0 in range(q0, end, CHUNK):
        tok = t0 + offs
        in_q = tok < end
        pos = s - q + (tok - q0)  # negative exactly for the tokens of an empty (padding) row
        real = pos >= 0
        slot = tl.load(slots_ptr + tok, mask=in_q, other=-1)
        page = tl.load(row + pos // BLOCK_SIZE, mask=in_q & real, other=0).to(tl.int64)
        want = tl.where(real, page * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
        bad = in_q & (slot != -1) & (slot != want)
        if tl.sum(bad.to(tl.int32), 0) > 0:
            first_bad = tl.min(tl.where(bad, tok, num_tokens), 0)
            _note(flag_ptr, 5, i, first_bad, _reported(tl.load(slots_ptr + first_bad)))
            tl.store(slots_ptr + tok, tl.full([CHUNK], -1, tl.int64), mask=bad)
        got = tl.load(positions_ptr + tok, mask=in_q, other=0)
        wrong = in_q & real & (got != pos)
        if tl.sum(wrong.to(tl.int32), 0) > 0:
            first_wrong = tl.min(tl.where(wrong, tok, num_tokens), 0)
            _note(flag_ptr, 6, i, first_wrong, _reported(tl.load(positions_ptr + first_wrong)))


def check_metadata(meta: AttentionMetadata, num_blocks: int, window: int | None, flag: torch.Tensor) -> None:
    """Launch the check over ``meta``'s padded rows (see :mod:`attention.metadata_check`)."""
    rows = meta.seq_lens.shape[0]
    _check_kernel[(rows,)](
        meta.seq_lens,
        meta.query_start_loc,
        meta.block_tables,
        meta.slot_mapping,
        meta.positions,
        flag,
        num_blocks,
        meta.num_tokens,
        window or 0,
        meta.block_tables.stride(0),
        rows,
        WIDTH=meta.table_width,
        BLOCK_SIZE=meta.block_size,
        HAS_WINDOW=window is not None,
        CHUNK=_CHUNK,
        num_warps=4,
    )
