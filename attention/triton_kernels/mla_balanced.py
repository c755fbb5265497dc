"""MLA decode on a length-balanced schedule: a fixed number of programs share a step's latent
tiles equally, across token boundaries (as FlashMLA's tile scheduler does).

The split schedule of :mod:`attention.triton_kernels.mla_decode` cuts every token's latents
into chunks of one length, so a batch of uneven lengths leaves some programs a full chunk and
others a sliver, and the last wave runs part-empty. Here the host numbers the step's tiles of
``BLOCK_N`` latents token after token, and program ``p`` takes one contiguous range of about
``tiles / programs`` of them, as one *segment* per token the range touches; a range that would
leave a sliver of a token (at most an eighth of a share) takes the rest of the token too. Each
segment stores a partial output (fp32, unnormalized), its running max and sum into a slot of
its own, and a second kernel merges each token's slots (log-sum-exp).

The plan is made on the host from the step's lengths (:func:`plan_mla_work`) and staged on the
device as one int32 array (:class:`MLAWork`), so a CUDA graph captured for a fixed
``programs`` replays any step of its shape. Layout, for ``T`` query tokens and ``P`` programs:

- ``[0, T + 1)``: tile offsets; token ``t`` holds tiles ``[cu[t], cu[t + 1])``;
- ``[T + 1, T + 1 + 5 P)``: per program: first tile, end tile, first token, last token, first
  slot (a program with no tiles: ``0, 0, 0, -1, 0``);
- then ``2 T``: per token, its first slot and its slot count (its segments' slots are
  consecutive).

Memory safety holds for any array: tokens are clamped to ``[0, T)``, slots outside the
partial buffer are neither stored nor read, and a segment's latents are clamped to its token's
``[0, seq_len)`` (what the split kernel reads).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from attention.triton_kernels.mla_tiles import (
    attend_latents,
    fold_partial,
    load_queries,
    store_merged,
    store_partial,
    token_extent,
)
from attention.triton_kernels.paging import next_power_of_2

__all__ = ["MLAWork", "launch_mla_balanced", "min_program_latents", "mla_work_len", "mla_work_programs",
           "plan_mla_work"]  # fmt: skip

#: Fields per program in the work array.
PROGRAM_FIELDS = 5
#: Latents per program, at least (below that the partial outputs cost more than they spread).
MIN_PROGRAM_LATENTS = 256
#: A program without tiles in the work array.
_IDLE_PROGRAM = array("i", [0, 0, 0, -1, 0])


@dataclass(frozen=True)
class MLAWork:
    """A step's balanced schedule on the device: ``data`` int32 [:func:`mla_work_len`] as laid
    out in the module docstring, for ``programs`` programs per head tile (the grid)."""

    data: torch.Tensor
    programs: int


def mla_work_len(tokens: int, programs: int) -> int:
    """Length of the work array for ``tokens`` query tokens and ``programs`` programs."""
    return 3 * tokens + 1 + PROGRAM_FIELDS * programs


def mla_work_programs(heads: int, block_h: int, programs_per_sm: int, num_sms: int) -> int:
    """Programs per head tile: every SM runs ``programs_per_sm`` of them at once (what the
    launch's shared memory lets stay resident), over all head tiles."""
    head_tiles = -(-heads // block_h)
    return max(1, programs_per_sm * num_sms // head_tiles)


def min_program_latents(heads: int) -> int:
    """Latents one program (or split) takes at least: ``64 * min(heads, 16)`` (1,024 from 16
    heads on) and :data:`MIN_PROGRAM_LATENTS`. With few heads the kernel is memory-bound and
    the partial output a program writes and the merge reads (``heads * kv_lora_rank`` floats)
    stays near 6% of its latent bytes; with many it is compute-bound and spreading matters more."""
    return max(MIN_PROGRAM_LATENTS, 64 * min(heads, 16))


def plan_mla_work(token_lens: Sequence[int], programs: int, block_n: int, min_latents: int) -> array:
    """The work array (``array('i')``, :func:`mla_work_len` long) sharing the tiles of
    ``token_lens`` (latents per query token; negative counts as 0) among at most ``programs``
    programs, each about ``max(tiles / programs, min_latents / block_n)`` tiles."""
    tokens = len(token_lens)
    cu = [0] * (tokens + 1)
    total = 0
    for t, n in enumerate(token_lens):
        if n > 0:
            total += (n + block_n - 1) // block_n
        cu[t + 1] = total
    share = max(1, -(-total // programs), -(-min_latents // block_n))
    slack = share // 8
    prog: list[int] = []
    slots = [0] * (2 * tokens)
    g = t = slot = used = 0
    while g < total and used < programs:
        while cu[t + 1] <= g:  # the token holding tile g (past tokens without tiles)
            t += 1
        used += 1
        end = g + share if used < programs and g + share < total else total
        last = t
        while cu[last + 1] < end:  # the token holding tile end - 1
            last += 1
        if cu[last + 1] - end <= slack:  # no sliver of a token left for the next program
            end = cu[last + 1]
        prog += (g, end, t, last, slot)
        if last == t:  # (most programs: one token)
            if not slots[2 * t + 1]:
                slots[2 * t] = slot
            slots[2 * t + 1] += 1
            slot += 1
        else:
            for u in range(t, last + 1):
                if cu[u + 1] > cu[u]:
                    if not slots[2 * u + 1]:
                        slots[2 * u] = slot
                    slots[2 * u + 1] += 1
                    slot += 1
        g, t = end, last
    work = array("i", cu + prog)
    work.extend(_IDLE_PROGRAM * (programs - used))
    work.extend(array("i", slots))
    return work


@triton.jit
def _segment(  # type: ignore[no-untyped-def]
    q_ptr, cache_ptr, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, t, g0, g1, slot, kv_scale,
    num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_qt, stride_qh,
    R: tl.constexpr, E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, DEQUANT: tl.constexpr,
    F16_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s tiles within ``[g0, g1)`` (if any): their partial output into ``slot``.
    Returns the next free slot."""
    t_first = tl.load(work_ptr + t)
    seg_start = tl.maximum(g0, t_first)
    seg_end = tl.minimum(g1, tl.load(work_ptr + t + 1))
    busy = seg_end > seg_start
    if busy:
        offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = offs_h < num_heads
        row, seq_len = token_extent(rows_ptr, lens_ptr, t, num_rows, table_width, BLOCK_SIZE)
        # Tile counts clamped before they become latents (no int32 overflow, whatever the array).
        most = tl.cdiv(table_width * BLOCK_SIZE, BLOCK_N)
        start = tl.minimum(tl.maximum(seg_start - t_first, 0), most) * BLOCK_N
        end = tl.minimum(tl.minimum(tl.maximum(seg_end - t_first, 0), most) * BLOCK_N, seq_len)
        q_lat, q_pe = load_queries(q_ptr, t, offs_h, head_ok, stride_qt, stride_qh, R, E, BLOCK_R, BLOCK_E, UPCAST,
                                   F16_DOTS)  # fmt: skip
        table_row = table_ptr + row.to(tl.int64) * table_width
        m_i, l_i, acc = attend_latents(
            q_lat, q_pe, cache_ptr, table_row, start, end, num_blocks, table_width, scale_log2, R, E, BLOCK_R,
            BLOCK_E, BLOCK_H, BLOCK_N, BLOCK_SIZE, UPCAST or DEQUANT, DOT_PRECISION,
        )  # fmt: skip
        if DEQUANT:
            acc = acc * kv_scale
        slot_ok = (slot >= 0) & (slot < num_slots)
        keep = tl.where(slot_ok, head_ok, False)  # (the interpreter takes no "mask & scalar")
        base = tl.where(slot_ok, slot, 0).to(tl.int64) * num_heads + offs_h.to(tl.int64)
        store_partial(acc_ptr, ml_ptr, base, keep, acc, m_i, l_i, R, BLOCK_R)
    return slot + busy.to(tl.int32)


@triton.jit
def _mla_balanced_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [T, H, D]
    cache_ptr,  # [num_blocks, block_size, 1, D]
    table_ptr,  # int32 [rows, table_width]
    rows_ptr,  # int32 [T]: each query token's table row
    lens_ptr,  # int32 [T]: the latents each query token sees
    work_ptr,  # int32 [mla_work_len(T, programs)]
    acc_ptr,  # fp32 [num_slots, H, R]
    ml_ptr,  # fp32 [num_slots, H, 2]: running max (log2 domain) and sum
    kv_scale_ptr,  # fp32 [1]: an fp8 latent's dequantization scale (read when DEQUANT)
    num_tokens,
    num_slots,
    num_rows,
    num_heads,
    num_blocks,
    table_width,
    scale_log2,
    stride_qt,
    stride_qh,
    R: tl.constexpr,
    E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DEQUANT: tl.constexpr,
    F16_DOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UNROLLED: tl.constexpr,  # segments run outside the loop over a program's tokens
):
    prog = work_ptr + num_tokens + 1 + tl.program_id(1) * 5
    g0 = tl.load(prog)
    g1 = tl.load(prog + 1)
    t0 = tl.minimum(tl.maximum(tl.load(prog + 2), 0), num_tokens - 1)
    t_stop = tl.where(g0 < g1, tl.minimum(tl.load(prog + 3), num_tokens - 1) + 1, t0)
    slot = tl.load(prog + 4)
    kv_scale = 1.0
    if DEQUANT:
        # fp8 latents convert exactly to the query's dtype; their scale multiplies the scores
        # (here) and the output (after the tiles) instead of every latent.
        kv_scale = tl.load(kv_scale_ptr)
        scale_log2 = scale_log2 * kv_scale
    # A program's first segments run unrolled: the loop around them cost the H200 5-8% at 16
    # heads (benchmarks/results/mla-decode-balanced-2026-12-04.md).
    for i in tl.static_range(UNROLLED):
        if t0 + i < t_stop:
            slot = _segment(
                q_ptr, cache_ptr, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, t0 + i, g0, g1, slot,
                kv_scale, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_qt, stride_qh,
                R, E, BLOCK_R, BLOCK_E, BLOCK_H, BLOCK_N, BLOCK_SIZE, UPCAST, DEQUANT, F16_DOTS, DOT_PRECISION,
            )  # fmt: skip
    for t in range(t0 + UNROLLED, t_stop):
        slot = _segment(
            q_ptr, cache_ptr, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, t + 0 * t0, g0, g1, slot,
            kv_scale, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_qt, stride_qh,
            R, E, BLOCK_R, BLOCK_E, BLOCK_H, BLOCK_N, BLOCK_SIZE, UPCAST, DEQUANT, F16_DOTS, DOT_PRECISION,
        )  # fmt: skip (t + 0 * t0: a tensor under the interpreter too)


@triton.jit
def _mla_balanced_merge_kernel(  # type: ignore[no-untyped-def]
    acc_ptr,  # fp32 [num_slots, H, R]
    ml_ptr,  # fp32 [num_slots, H, 2]
    work_ptr,  # int32 [mla_work_len(T, programs)]
    out_ptr,  # [T, H, >= R] (channels contiguous)
    num_tokens,
    num_programs,
    num_slots,
    num_heads,
    stride_ot,
    stride_oh,
    tail,  # channels after the first R to zero
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """One (token, head): the log-sum-exp merge of its slots (a token without any: zeros)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    entry = work_ptr + num_tokens + 1 + 5 * num_programs + 2 * token
    first = tl.minimum(tl.maximum(tl.load(entry), 0), num_slots)
    stop = tl.minimum(first + tl.maximum(tl.load(entry + 1), 0), num_slots)
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s in range(first, stop):
        base = (s + 0 * first).to(tl.int64) * num_heads + head  # (a tensor under the interpreter too)
        m_run, l_run, acc = fold_partial(acc_ptr, ml_ptr, base, m_run, l_run, acc, R, BLOCK_R)
    acc = acc / tl.where(l_run > 0, l_run, 1.0)
    store_merged(out_ptr, token, head, stride_ot, stride_oh, acc, tail, R, BLOCK_R, BLOCK_TAIL)


def launch_mla_balanced(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    work: MLAWork,
    kv_scale: torch.Tensor | None,
    out: torch.Tensor,
    scale_log2: float,
    consts: dict[str, Any],
    *,
    tail: int,
    unrolled: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """Both kernels on arguments :func:`attention.triton_kernels.mla_decode.mla_attention` has
    checked; ``consts``: the attention kernel's compile-time arguments but ``UNROLLED``;
    ``tail``: channels of ``out`` after the first R the merge zeroes."""
    tokens, heads, _ = query.shape
    rank = consts["R"]
    slots = work.programs + tokens  # a program's segments: the tokens it touches
    acc = torch.empty(slots, heads, rank, dtype=torch.float32, device=query.device)
    ml = torch.empty(slots, heads, 2, dtype=torch.float32, device=query.device)
    _mla_balanced_kernel[(triton.cdiv(heads, consts["BLOCK_H"]), work.programs)](
        query, cache, tables, rows, lens, work.data, acc, ml, kv_scale if kv_scale is not None else acc, tokens,
        slots, tables.shape[0], heads, cache.shape[0], tables.shape[1], scale_log2, query.stride(0), query.stride(1),
        **consts, UNROLLED=unrolled, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _mla_balanced_merge_kernel[(tokens, heads)](
        acc, ml, work.data, out, tokens, work.programs, slots, heads, out.stride(0), out.stride(1), tail, R=rank,
        BLOCK_R=consts["BLOCK_R"], BLOCK_TAIL=next_power_of_2(tail) if tail else 0, num_warps=4,
    )  # fmt: skip
