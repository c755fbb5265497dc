"""MLA decode on a length-balanced schedule: a fixed number of programs share a step's latent
tiles in contiguous runs, across token boundaries (as FlashMLA's tile scheduler does).

The split schedule of :mod:`attention.triton_kernels.mla_decode` cuts every token's latents
into chunks of one length, so a batch of uneven lengths leaves some programs a full chunk and
others a sliver, and the last wave runs part-empty. Here the host numbers the step's tiles of
``BLOCK_N`` latents token after token, and program ``p`` takes one contiguous range of them, as
one *segment* per token the range touches. A program's cost is its tiles plus
:data:`SEGMENT_COST_LATENTS` for each token it starts after its first, and the ranges make the
busiest program's cost the least any contiguous sharing has (on 128 LogNormal rows over 132
programs: 43 tiles where equal shares that avoid slivers of a token gave 47). Each segment
stores a partial output (unnormalized; fp16 scaled by a power of two for 16-bit queries over a
16-bit latent, else fp32: :func:`partial_dtype`), its running max and sum into a slot of its own,
and a second kernel merges each token's slots (log-sum-exp): ``programs + tokens`` slots at
most.

A step of many tokens (``direct``, :func:`mla_direct_store`: when those slots would pass
:data:`DIRECT_STORE_BYTES`) gives slots only to the tokens split across programs: a token that
one segment covers whole is normalized and stored into the output by its program. Only a
program's first and last tokens can be split, so such a step uses at most ``2 * programs``
slots, whatever its token count (:func:`mla_work_slots`). Not always, because the larger
epilogue slows the kernel where few tokens are whole: on the H200 3-4% at 128 heads on 64 x
4096 and LogNormal rows, 1% at 16 heads; 512 rows of 512 run 4% faster direct at 16 heads
(``results/mla-decode-direct-2026-12-04.md``).

The plan is made on the host from the step's lengths (:func:`plan_mla_work`) and staged on the
device as one int32 array (:class:`MLAWork`), so a CUDA graph captured for a fixed
``programs`` replays any step of its shape. Layout, for ``T`` query tokens and ``P`` programs:

- ``[0, T + 1)``: tile offsets; token ``t`` holds tiles ``[cu[t], cu[t + 1])``;
- ``[T + 1, T + 1 + 5 P)``: per program: first tile, end tile, first token, last token, and
  the slot of its first token's segment (-1 when that token has no slot; a program with no
  tiles: ``0, 0, 0, -1, -1``);
- then ``2 T``: per token, its first slot and its segment count. A token's slots are
  consecutive, one per segment in program order; a token without latents (count 0), and with
  ``direct`` a token of one segment, has first slot -1. A program's later tokens start in it,
  so their segment takes the token's first slot;
- with ``counters`` (planned for the Hopper kernel's merge in the kernel,
  :mod:`.mla_decode_hopper`'s ``fused_merge``), then ``16 T`` zeros: per token, a counter of
  its finished segments for each of 16 heads, which the kernel sets back to zero, so every
  launch of a step's layers finds zeros. Without, a plan carries none (nothing to stage).

Memory safety holds for any array: tokens are clamped to ``[0, T)`` (a direct store stays in
the output), slots outside the partial buffer are neither stored nor read, and a segment's
latents are clamped to its token's ``[0, seq_len)`` (what the split kernel reads).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from attention.errors import InvalidArgumentError
from attention.triton_kernels.mla_tiles import (
    attend_latents,
    fold_partial,
    load_queries,
    store_merged,
    store_normalized,
    store_partial,
    store_tail,
    token_extent,
)
from attention.triton_kernels.paging import next_power_of_2

__all__ = [
    "MLAWork",
    "launch_mla_balanced",
    "min_program_latents",
    "mla_direct_store",
    "mla_work_len",
    "mla_work_programs",
    "mla_work_slots",
    "partial_dtype",
    "plan_mla_work",
]  # fmt: skip

#: Fields per program in the work array.
PROGRAM_FIELDS = 5
#: Counters per token at the work array's end (the Hopper kernel's merge in the kernel counts
#: each head's finished segments apart: its 16 heads).
FUSED_COUNTERS = 16
#: Latents per program, at least (below that the partial outputs cost more than they spread).
MIN_PROGRAM_LATENTS = 256
#: Partial outputs of one launch (bytes) above which tokens of one segment are stored directly.
DIRECT_STORE_BYTES = 64 << 20
#: What a program pays, in latents, for each token it starts after its first: reading the
#: token's queries, refilling the tile pipeline and storing one more partial output (about
#: one 64-latent tile's load: on the H200, 63 of 264 programs crossing a row made a 64 x 4096
#: step 7% longer, about 70 latents a crossing; ``results/mla-decode-balanced-2026-12-04.md``).
SEGMENT_COST_LATENTS = 64
#: The partial outputs' dtype under 16-bit queries (:func:`partial_dtype`): half the bytes of
#: float32; a segment's stores had cost more than their bytes suggest (the Hopper kernel's:
#: ``benchmarks/results/mla-decode-partials-h100-2026-12-06.md``).
PARTIAL_DTYPE_16BIT = torch.float16
#: A program without tiles in the work array.
_IDLE_PROGRAM = array("i", [0, 0, 0, -1, -1])


@dataclass(frozen=True)
class MLAWork:
    """A step's balanced schedule on the device: ``data`` int32 [:func:`mla_work_len`] as laid
    out in the module docstring, for ``programs`` programs per head tile (the grid);
    ``direct``: planned so (``plan_mla_work(..., direct=True)``), tokens of one segment are
    stored by their program; ``counters``: planned with the fused merge's counters
    (``plan_mla_work(..., counters=True)``). It must match the plan: a mismatch stays
    memory-safe but gives wrong outputs."""

    data: torch.Tensor
    programs: int
    direct: bool = False
    counters: bool = False


def partial_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The partial outputs' dtype: :data:`PARTIAL_DTYPE_16BIT` (float16, scaled per head by a
    power of two, :func:`.mla_tiles.store_partial`) for 16-bit queries over a 16-bit latent,
    whose outputs round to 8 or 11 bits anyway; float32 otherwise: under float32 queries, and
    over an fp8 latent, where the Triton kernel ran 0.97x as fast with fp16 partials on an H100
    (``benchmarks/results/mla-decode-partials-h100-2026-12-06.md``)."""
    sixteen = (torch.bfloat16, torch.float16)
    return PARTIAL_DTYPE_16BIT if query_dtype in sixteen and cache_dtype in sixteen else torch.float32


def mla_work_len(tokens: int, programs: int, counters: bool = False) -> int:
    """Length of the work array for ``tokens`` query tokens and ``programs`` programs (with the
    fused merge's ``counters``)."""
    return (3 + (FUSED_COUNTERS if counters else 0)) * tokens + 1 + PROGRAM_FIELDS * programs


def mla_work_slots(programs: int, tokens: int, direct: bool) -> int:
    """Partial-output slots a schedule of ``programs`` programs over ``tokens`` query tokens
    uses, at most: a slot per segment, and a program's segments are the tokens it touches;
    with ``direct`` only a program's first and last tokens can take slots."""
    return 2 * programs if direct else programs + tokens


def mla_direct_store(tokens: int, programs: int, heads: int, rank: int) -> bool:
    """Whether a step of ``tokens`` query tokens should be planned ``direct``: its partial
    outputs (``heads * rank`` floats per slot) would otherwise pass :data:`DIRECT_STORE_BYTES`."""
    return mla_work_slots(programs, tokens, False) * heads * rank * 4 > DIRECT_STORE_BYTES


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


def _fill_programs(starts: list[int], cost_starts: list[int], programs: int, most: int, segment_cost: int) -> list[int]:
    """The end tiles of at most ``programs`` programs, each taking the tiles after the last
    one's while its cost (tiles, plus ``segment_cost`` for every token after its first) stays
    within ``most``; empty when they cannot place every tile. Taking as much as it can never
    leaves later programs more to do, so the least ``most`` that places every tile is the least
    makespan any contiguous partition has.

    ``starts``: the first tile of each token with tiles, then the total; ``cost_starts``: the
    same in cost (``starts[k] + k * segment_cost``)."""
    total, tokens = starts[-1], len(starts) - 1
    ends: list[int] = []
    g = token = 0  # the next tile and the token holding it
    left = programs
    while g < total:
        if total - g > left * most:
            return []
        cost_end = g + token * segment_cost + most  # a tile x of token k fits if x + k * cost < it
        last = bisect_left(cost_starts, cost_end, token, tokens) - 1
        g = min(starts[last + 1], cost_end - last * segment_cost)
        ends.append(g)
        token = last if g < starts[last + 1] else last + 1
        left -= 1
    return ends


def plan_mla_work(
    token_lens: Sequence[int],
    programs: int,
    block_n: int,
    min_latents: int,
    *,
    direct: bool = False,
    counters: bool = False,
) -> array:
    """The work array (``array('i')``, :func:`mla_work_len` long) sharing the tiles of
    ``token_lens`` (latents per query token; negative counts as 0) among at most ``programs``
    programs; ``direct``: slots only for tokens split across programs; ``counters``: the zeros
    the Hopper kernel's merge in the kernel counts on (see the module docstring).

    The ranges keep the busiest program's cost least: tiles, plus
    :data:`SEGMENT_COST_LATENTS` (in tiles) for each token after a program's first. A program
    takes at least ``min_latents / block_n`` tiles (fewer programs for a short step)."""
    for name, value in (("programs", programs), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"plan_mla_work: {name} is {value!r}; it must be an int >= 1")
    tokens = len(token_lens)
    cu = [0] * (tokens + 1)
    total = 0
    for t, n in enumerate(token_lens):
        if n > 0:
            total += (n + block_n - 1) // block_n
        cu[t + 1] = total
    segment_cost = max(1, SEGMENT_COST_LATENTS // block_n)
    busy = [t for t in range(tokens) if cu[t + 1] > cu[t]]  # the tokens with tiles
    starts = [cu[t] for t in busy] + [total]
    cost_starts = [s + k * segment_cost for k, s in enumerate(starts)]

    def fill(most: int) -> list[int]:
        return _fill_programs(starts, cost_starts, programs, most, segment_cost)

    lower = max(1, -(-total // programs), -(-min_latents // block_n))  # no makespan below it
    # Every token after a program's first costs it a segment: about one per token in all.
    guess = max(lower, -(-(total + segment_cost * max(len(busy) - 1, 0)) // programs))
    ends = fill(guess)
    # From the guess, steps of doubling length bracket the least makespan that fits in
    # (low, high]; halving the bracket finds it.
    if ends or not total:  # step down
        low, high, step = lower - 1, guess, 1
        while high - step > low:
            tried = fill(high - step)
            if not tried:
                low = high - step
                break
            high, ends, step = high - step, tried, 2 * step
    else:  # step up
        low, step = guess, 1
        while not ends:
            high = low + step
            ends = fill(high)
            if not ends:
                low, step = high, 2 * step
    while high - low > 1:
        mid = (low + high) // 2
        tried = fill(mid)
        if tried:
            high, ends = mid, tried
        else:
            low = mid
    prog: list[int] = []
    segments = [0] * tokens  # per token, the programs touching it
    first_ordinal: list[int] = []  # per program, its segment's place among its first token's
    g = k = 0
    for end in ends:
        while starts[k + 1] <= g:  # the token holding tile g
            k += 1
        t = busy[k]
        first_ordinal.append(segments[t])
        segments[t] += 1
        while starts[k + 1] < end:  # every later token with tiles in [g, end)
            k += 1
            segments[busy[k]] += 1
        prog += (g, end, t, busy[k], 0)
        g = end
    used = len(ends)
    slots = [-1] * (2 * tokens)
    slot = 0
    least = 2 if direct else 1  # the segments a token needs for slots
    for u, count in enumerate(segments):
        slots[2 * u + 1] = count
        if count >= least:
            slots[2 * u] = slot
            slot += count
    for p, ordinal in enumerate(first_ordinal):
        t = prog[5 * p + 2]
        prog[5 * p + 4] = slots[2 * t] + ordinal if segments[t] >= least else -1
    work = array("i", cu + prog)
    work.extend(_IDLE_PROGRAM * (programs - used))
    work.extend(array("i", slots))
    if counters:
        work.extend(array("i", bytes(4 * FUSED_COUNTERS * tokens)))
    return work


@triton.jit
def program_work(work_ptr, num_tokens, pid, num_programs):  # type: ignore[no-untyped-def]
    """Program ``pid``'s entry of the work array: its tile range ``[g0, g1)``, its tokens
    ``[t0, t_stop)`` (clamped to the step; none for an empty range), its first token's slot,
    and the pointer to the per-token slot table. Scalars only: the Gluon kernel of
    :mod:`.mla_decode_hopper` calls it too."""
    prog = work_ptr + num_tokens + 1 + pid * 5
    g0 = tl.load(prog)
    g1 = tl.load(prog + 1)
    t0 = tl.minimum(tl.maximum(tl.load(prog + 2), 0), num_tokens - 1)
    t_stop = tl.where(g0 < g1, tl.minimum(tl.load(prog + 3), num_tokens - 1) + 1, t0)
    return g0, g1, t0, t_stop, tl.load(prog + 4), work_ptr + num_tokens + 1 + num_programs * 5


@triton.jit
def segment_latents(  # type: ignore[no-untyped-def]
    t_first, seg_start, seg_end, seq_len, table_width, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The latents ``[start, end)`` of a token's segment (tiles ``[seg_start, seg_end)`` of the
    step, the token's first tile ``t_first``), its tile counts clamped to the table before they
    become latents (no int32 overflow, whatever the array) and ``end`` to ``seq_len``."""
    most = tl.cdiv(table_width * BLOCK_SIZE, BLOCK_N)
    start = tl.minimum(tl.maximum(seg_start - t_first, 0), most) * BLOCK_N
    end = tl.minimum(tl.minimum(tl.maximum(seg_end - t_first, 0), most) * BLOCK_N, seq_len)
    return start, end


@triton.jit
def _segment(  # type: ignore[no-untyped-def]
    q_ptr, cache_ptr, table_ptr, rows_ptr, lens_ptr, work_ptr, token_slots_ptr, acc_ptr, ml_ptr, out_ptr, t, g0, g1,
    first_slot, kv_scale, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_qt, stride_qh,
    stride_ot, stride_oh,
    R: tl.constexpr, E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, DEQUANT: tl.constexpr,
    F16_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s tiles within ``[g0, g1)`` (if any): a partial output into ``first_slot``
    (the program's first token) or the token's first slot (a later token, whose first segment
    this is); under ``DIRECT``, a token of one segment: its output into ``out``."""
    t_first = tl.load(work_ptr + t)
    seg_start = tl.maximum(g0, t_first)
    seg_end = tl.minimum(g1, tl.load(work_ptr + t + 1))
    if seg_end > seg_start:
        offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = offs_h < num_heads
        row, seq_len = token_extent(rows_ptr, lens_ptr, t, num_rows, table_width, BLOCK_SIZE)
        start, end = segment_latents(t_first, seg_start, seg_end, seq_len, table_width, BLOCK_SIZE, BLOCK_N)
        q_lat, q_pe = load_queries(q_ptr, t, offs_h, head_ok, stride_qt, stride_qh, R, E, BLOCK_R, BLOCK_E, UPCAST,
                                   F16_DOTS)  # fmt: skip
        table_row = table_ptr + row.to(tl.int64) * table_width
        m_i, l_i, acc = attend_latents(
            q_lat, q_pe, cache_ptr, table_row, start, end, num_blocks, table_width, scale_log2, R, E, BLOCK_R,
            BLOCK_E, BLOCK_H, BLOCK_N, BLOCK_SIZE, UPCAST or DEQUANT, DOT_PRECISION,
        )  # fmt: skip
        if DEQUANT:
            acc = acc * kv_scale
        slot = tl.where(seg_start == g0, first_slot, tl.load(token_slots_ptr + 2 * t))
        if DIRECT:
            if tl.load(token_slots_ptr + 2 * t + 1) == 1:  # the whole token: normalize and store
                store_normalized(out_ptr, t, offs_h, head_ok, stride_ot, stride_oh, acc, l_i, R, BLOCK_R)
            else:
                _store_slot(acc_ptr, ml_ptr, slot, num_slots, num_heads, offs_h, head_ok, acc, m_i, l_i, R, BLOCK_R)
        else:
            _store_slot(acc_ptr, ml_ptr, slot, num_slots, num_heads, offs_h, head_ok, acc, m_i, l_i, R, BLOCK_R)


@triton.jit
def _store_slot(  # type: ignore[no-untyped-def]
    acc_ptr, ml_ptr, slot, num_slots, num_heads, offs_h, head_ok, acc, m_i, l_i, R: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """A segment's partial output into ``slot`` (nothing for a slot outside the buffer)."""
    slot_ok = (slot >= 0) & (slot < num_slots)
    keep = tl.where(slot_ok, head_ok, False)  # (the interpreter takes no "mask & scalar")
    base = tl.where(slot_ok, slot, 0).to(tl.int64) * num_heads + offs_h.to(tl.int64)
    store_partial(acc_ptr, ml_ptr, base, keep, acc, m_i, l_i, R, BLOCK_R)


@triton.jit(do_not_specialize=["num_tokens", "num_slots", "num_rows", "table_width"])  # per-step sizes
def _mla_balanced_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [T, H, D]
    cache_ptr,  # [num_blocks, block_size, 1, D]
    table_ptr,  # int32 [rows, table_width]
    rows_ptr,  # int32 [T]: each query token's table row
    lens_ptr,  # int32 [T]: the latents each query token sees
    work_ptr,  # int32 [mla_work_len(T, programs)]
    acc_ptr,  # fp32 or fp16 (scaled with its max and sum) [num_slots, H, R]
    ml_ptr,  # fp32 [num_slots, H, 2]: running max (log2 domain) and sum
    out_ptr,  # [T, H, >= R]: tokens of one segment are stored here
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
    stride_ot,
    stride_oh,
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
    DIRECT: tl.constexpr,  # the work was planned direct: tokens of one segment go to out
):
    g0, g1, t0, t_stop, first_slot, token_slots = program_work(
        work_ptr, num_tokens, tl.program_id(1), tl.num_programs(1)
    )
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
            _segment(
                q_ptr, cache_ptr, table_ptr, rows_ptr, lens_ptr, work_ptr, token_slots, acc_ptr, ml_ptr, out_ptr,
                t0 + i, g0, g1, first_slot, kv_scale, num_slots, num_rows, num_heads, num_blocks, table_width,
                scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, R, E, BLOCK_R, BLOCK_E, BLOCK_H, BLOCK_N,
                BLOCK_SIZE, UPCAST, DEQUANT, F16_DOTS, DOT_PRECISION, DIRECT,
            )  # fmt: skip
    for t in range(t0 + UNROLLED, t_stop):
        _segment(
            q_ptr, cache_ptr, table_ptr, rows_ptr, lens_ptr, work_ptr, token_slots, acc_ptr, ml_ptr, out_ptr,
            t + 0 * t0, g0, g1, first_slot, kv_scale, num_slots, num_rows, num_heads, num_blocks, table_width,
            scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, R, E, BLOCK_R, BLOCK_E, BLOCK_H, BLOCK_N,
            BLOCK_SIZE, UPCAST, DEQUANT, F16_DOTS, DOT_PRECISION, DIRECT,
        )  # fmt: skip (t + 0 * t0: a tensor under the interpreter too)


@triton.jit(do_not_specialize=["num_tokens", "num_slots", "token_base"])
def _mla_balanced_merge_kernel(  # type: ignore[no-untyped-def]
    acc_ptr,  # fp32 [num_slots, H, R] (or fp16, scaled with its max and sum)
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
    token_base,  # the token of program (0, h): a launch may cover a range of the tokens
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    DIRECT: tl.constexpr,  # tokens of one segment were stored by the attention kernel
    AFTER_PDL: tl.constexpr = False,  # launched dependent on the attention kernel: wait for it first
    SKIP_UNSEEN: tl.constexpr = False,  # a token without latents: store nothing
):
    """One (token, head): the log-sum-exp merge of its slots (a token without latents: zeros,
    or nothing under ``SKIP_UNSEEN``; under ``DIRECT`` a token of one segment, already stored:
    its tail only). ``AFTER_PDL``: the launch was programmatic-dependent (``launch_pdl``) on the
    attention kernel, so it may start before that kernel ends; it waits for it (and its stores)
    before anything else."""
    if AFTER_PDL:
        gdc_wait()
    token = token_base + tl.program_id(0)
    head = tl.program_id(1)
    entry = work_ptr + num_tokens + 1 + 5 * num_programs + 2 * token
    count = tl.load(entry + 1)
    if SKIP_UNSEEN and count <= 0:
        return
    if DIRECT and count == 1:
        store_tail(out_ptr, token, head, stride_ot, stride_oh, tail, R, BLOCK_TAIL)
    else:
        first = tl.minimum(tl.maximum(tl.load(entry), 0), num_slots)
        stop = tl.minimum(first + tl.maximum(count, 0), num_slots)
        m_run = float("-inf")
        l_run = 0.0
        acc = tl.zeros([BLOCK_R], tl.float32)
        for s in range(first, stop):
            base = (s + 0 * first).to(tl.int64) * num_heads + head  # (a tensor under the interpreter too)
            m_run, l_run, acc = fold_partial(acc_ptr, ml_ptr, base, m_run, l_run, acc, R, BLOCK_R)
        acc = acc / tl.where(l_run > 0, l_run, 1.0)
        store_merged(out_ptr, token, head, stride_ot, stride_oh, acc, tail, R, BLOCK_R, BLOCK_TAIL)


def merge_range(tokens: int, merge_tokens: tuple[int, int] | None) -> tuple[int, int]:
    """The tokens a merge launch covers: ``merge_tokens`` (checked by the caller to lie in
    ``[0, tokens]``), or all."""
    return (0, tokens) if merge_tokens is None else merge_tokens


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
    skip_unseen: bool = False,
    merge_tokens: tuple[int, int] | None = None,
) -> None:
    """Both kernels on arguments :func:`attention.triton_kernels.mla_decode.mla_attention` has
    checked; ``consts``: the attention kernel's compile-time arguments but ``UNROLLED``;
    ``tail``: channels of ``out`` after the first R the merge zeroes; ``skip_unseen``: tokens
    without latents keep their rows of ``out`` (else zeros); ``merge_tokens``: the merge runs
    on these tokens only (:func:`merge_range`)."""
    tokens, heads, _ = query.shape
    rank = consts["R"]
    slots = mla_work_slots(work.programs, tokens, work.direct)
    acc = torch.empty(slots, heads, rank, dtype=partial_dtype(query.dtype, cache.dtype), device=query.device)
    ml = torch.empty(slots, heads, 2, dtype=torch.float32, device=query.device)
    _mla_balanced_kernel[(triton.cdiv(heads, consts["BLOCK_H"]), work.programs)](
        query, cache, tables, rows, lens, work.data, acc, ml, out, kv_scale if kv_scale is not None else ml,
        tokens, slots, tables.shape[0], heads, cache.shape[0], tables.shape[1], scale_log2, query.stride(0),
        query.stride(1), out.stride(0), out.stride(1), **consts, UNROLLED=unrolled, DIRECT=work.direct,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    first, stop = merge_range(tokens, merge_tokens)
    if stop <= first:
        return
    _mla_balanced_merge_kernel[(stop - first, heads)](
        acc, ml, work.data, out, tokens, work.programs, slots, heads, out.stride(0), out.stride(1), tail, first, R=rank,
        BLOCK_R=consts["BLOCK_R"], BLOCK_TAIL=next_power_of_2(tail) if tail else 0, DIRECT=work.direct,
        SKIP_UNSEEN=skip_unseen, num_warps=4,
    )  # fmt: skip
