"""Host-side work partition for the paged decode kernel: rows cut into equal-token chunks.

A decode step attends ``R`` rows, row ``d`` over its K/V tokens ``[kv_start, kv_end)``. A row
brings ``q_len`` new tokens (1, or up to :data:`MAX_DECODE_QUERY_LEN` when it verifies draft
tokens), the last ``q_len`` of its range, causal among themselves. The
kernel runs one program per (work item, KV head); an *item* is one chunk of one row. Chunks
have one length for the whole step (``chunk_len``, a multiple of the kernel's tile), so a row
of L tokens gets about ``L / chunk_len`` items: programs are balanced by tokens, not sized by
the longest row. Chunk boundaries sit at multiples of ``chunk_len`` in absolute token
positions, so every chunk but a row's first starts on a tile boundary, also when
``kv_start > 0`` (sliding windows).

``chunk_len`` is the shorter of two lengths, never below ``min_chunk_tokens``:

- parallelism (FlashInfer-style): when the rows alone give fewer than ``programs_per_sm``
  (item x KV head) programs per SM, the shortest chunk whose items stay within that many
  programs, so HBM has enough requests in flight;
- balance: ``balance`` x the batch's mean row length, so with rows of very different
  lengths the long ones split and no program reads much more than a typical row. Rows of
  one length never split for it. With a ``slot_share``, never shorter than that fraction of
  a place's share of the step (tokens x KV heads / (``programs_per_sm`` x SMs)): with many
  more programs than places, a row within that share ends no later than the others whole.

In a batch too small to give every SM one program at ``min_chunk_tokens`` (1 row x 1024
tokens on 8 KV heads), chunks may shrink to ``small_batch_chunk_tokens``. With a
``wave_fill`` policy (an fp8 cache at block 32), a batch of near-equal rows whose programs
fill the SMs more than once but leave the second wave mostly idle (64 rows x 8 KV heads = 512
programs for 396 places: 1.29 waves) cuts each row into up to :data:`WAVE_FILL_SPLITS`
pieces, the fewest whose waves are at least ``wave_fill`` full (3 pieces: 1,536 programs, 3.9
waves). A fixed grid (``max_items``) too small for that chunk makes it grow until the items
fit.

The defaults started from a model (HBM shared by the resident programs, each capped at what
its own pipeline keeps in flight: ~20 GB/s on the H200, which is why flash-attn needs 354 us
for a 64-row LogNormal batch whose longest row alone streams for about that long) and were
then set by an H200 sweep (benchmarks/results/decode-policy-2026-12-02.json): 3 programs per
SM and balance 1.25 were at or above the previous 2 / 1.5 on every benchmark shape at blocks
32 and 256 (16 rows x 16384 tokens: 0.89x -> 1.02x of flash-attn). Balance 1.0 was faster
still on LogNormal batches but splits near-uniform batches for a few tokens. bench_decode.py
--sweep times a finer and a coarser policy.

For CUDA graphs the kernel's grid is fixed per batch bucket: :func:`max_decode_items` and
:func:`max_decode_partials` depend only on the bucket's row count (never on lengths) and bound
every schedule :func:`schedule_decode` makes for that many rows or fewer. Pure Python, no torch.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import add, index, le, lt, sub

__all__ = [
    "ITEM_FIELDS",
    "MAX_DECODE_QUERY_LEN",
    "PAD_ITEM",
    "PAD_ROW",
    "ROW_FIELDS",
    "WAVE_FILL_SPLITS",
    "DecodePolicy",
    "DecodeSchedule",
    "max_decode_items",
    "max_decode_partials",
    "schedule_decode",
]

#: int32 fields of one item: (d, kv_start, kv_end, partial_slot, table_row, q_token,
#: num_chunks, first_partial, q_len, row_end). The row's fields ride along so a program reads
#: everything it needs in one burst of loads before its first block-table read (one memory
#: latency, not two). partial_slot is -1 when the row has one chunk (the program writes the
#: output itself); row_end is the row's kv_end (its new tokens' causal limits).
ITEM_FIELDS = 10
#: int32 fields of one row: (table_row, q_token, num_chunks, first_partial, q_len).
ROW_FIELDS = 5
#: Filler of the item array past ``num_items``: d = -1 makes the program exit at once.
PAD_ITEM = (-1, 0, 0, -1, -1, -1, 0, -1, 1, 0)
#: Filler of the row array past ``num_rows``: num_chunks = 0, nothing to combine.
PAD_ROW = (-1, -1, 0, -1, 1)
#: Most new tokens a decode row may bring (a row verifying up to 7 draft tokens).
MAX_DECODE_QUERY_LEN = 8
#: Most pieces a ``wave_fill`` policy cuts a row into (it bounds a CUDA graph's grid).
WAVE_FILL_SPLITS = 3
#: Largest value of an int32 field.
_INT32_MAX = (1 << 31) - 1
#: An item's and a row's fields as native int32 bytes (the layout of ``array("i")``).
_ITEM = struct.Struct(f"={ITEM_FIELDS}i")
_ROW = struct.Struct(f"={ROW_FIELDS}i")
_PACKED_PAD_ITEM, _PACKED_PAD_ROW = _ITEM.pack(*PAD_ITEM), _ROW.pack(*PAD_ROW)


@dataclass(frozen=True)
class DecodePolicy:
    """How :func:`schedule_decode` picks the chunk length.

    programs_per_sm:  (item x KV head) programs wanted per SM when the rows alone give
                      fewer: a memory-bound launch needs about this many in flight.
    balance:          longest chunk, in units of the batch's mean row length (> 0): long
                      rows split into pieces no longer than this, so programs read similar
                      amounts. An R-row batch then has at most ``R * (1 + 1 / balance)``
                      items (rows starting at 0).
    min_chunk_tokens: shortest chunk: below it, per-program start-up and the combine step
                      cost more than the parallelism gains.
    small_batch_chunk_tokens: shortest chunk in a batch that cannot give every SM one
                      program at ``min_chunk_tokens`` (1 row x 1024 tokens on 8 KV heads).
    wave_fill:        0 (off), or in (0, 1]: when near-equal rows (the shortest >= 3/4 of
                      the longest, none split) give more programs than the SMs hold at once
                      (``programs_per_sm`` each) but fewer than twice that, and their two
                      waves are less than this full, cut each row into the fewest pieces
                      (<= WAVE_FILL_SPLITS, each >= ``min_chunk_tokens``) whose waves are at
                      least this full. For launches whose programs are limited by an SM's
                      issue rate (an fp8 cache's conversions), where a mostly empty second
                      wave leaves SMs idle. On the H200 (bench_decode.py --wave-fill,
                      benchmarks/results/decode-wave-fill-2026-12-05.json): fp8 at block 32,
                      64 rows x 4096 tokens, 0.190 -> 0.164 ms (3 pieces); with more waves it
                      lost (fp8 128 x 2048: 0.154 -> 0.172 ms, 256 x 1024: 0.151 -> 0.191), and
                      the bf16 and int8 caches lost at every shape it cut (5-25%).
    slot_share:       0 (off), or in (0, 4]: chunks are at least this fraction of a place's
                      share of the step (the step's tokens x KV heads / (programs_per_sm x SMs)).
                      With many more programs than places, the places take programs one
                      after another, heaviest first, and a row no longer than a place's share
                      of the work ends no later than the others: splitting it only adds
                      programs and partials to merge.
    """

    programs_per_sm: int = 3
    balance: float = 1.25
    min_chunk_tokens: int = 256
    small_batch_chunk_tokens: int = 64
    wave_fill: float = 0.0
    slot_share: float = 0.0

    def __post_init__(self) -> None:
        if self.programs_per_sm < 1:
            raise ValueError(f"DecodePolicy.programs_per_sm: {self.programs_per_sm} must be >= 1")
        if not self.balance > 0:
            raise ValueError(f"DecodePolicy.balance: {self.balance} must be > 0")
        if self.small_batch_chunk_tokens < 1 or self.min_chunk_tokens < self.small_batch_chunk_tokens:
            raise ValueError(
                f"DecodePolicy: need 1 <= small_batch_chunk_tokens ({self.small_batch_chunk_tokens}) "
                f"<= min_chunk_tokens ({self.min_chunk_tokens})"
            )
        if not 0.0 <= self.wave_fill <= 1.0:
            raise ValueError(f"DecodePolicy.wave_fill: {self.wave_fill} must be in [0, 1] (0: off)")
        if not 0.0 <= self.slot_share <= 4.0:
            raise ValueError(f"DecodePolicy.slot_share: {self.slot_share} must be in [0, 4] (0: off)")


@dataclass(frozen=True)
class DecodeSchedule:
    """One step's partition of its decode rows into items (see the module docstring).

    chunk_len:    tokens per chunk, a multiple of ``block_n`` (the tile it was made for).
    num_rows:     rows scheduled (R); num_items: items used (<= grid_items).
    grid_items:   programs per KV head to launch: ``max_items`` when one was given (a fixed
                  CUDA-graph grid), else ``num_items``.
    grid_rows:    rows the combine step covers: ``max_rows`` when given, else R.
    query_len:    new tokens per row the launch is compiled for (a power of two >= every
                  row's q_len): ``max_query_len`` when given (a CUDA-graph bucket), else the
                  smallest that fits this step's rows.
    num_partials: partial-output slots used (rows with more than one chunk only: a row of n
                  chunks and q new tokens owns n * q, token t's chunk j at first + t * n + j).
    items:        int32, ``grid_items * ITEM_FIELDS`` values (see ITEM_FIELDS), heaviest
                  item first, padded with PAD_ITEM.
    rows:         int32, ``grid_rows * ROW_FIELDS`` values (see ROW_FIELDS), padded with PAD_ROW.
    fixed_grid:   made with ``max_items``: launches must not depend on this step's counts.
    max_table_row, max_q_token: largest block-table row and query token named (-1 if none;
                  a row's last new token counts), so a launcher checks them against its
                  tensors in O(1).
    """

    chunk_len: int
    block_n: int
    num_rows: int
    num_items: int
    grid_items: int
    grid_rows: int
    query_len: int
    num_partials: int
    items: array = field(repr=False)
    rows: array = field(repr=False)
    fixed_grid: bool
    max_table_row: int
    max_q_token: int

    @property
    def needs_combine(self) -> bool:
        """Whether a launch must run the combine step: some row has several chunks now, or
        (fixed grid) may have in a later step replayed on the same grid."""
        if self.fixed_grid:
            return self.grid_items > self.grid_rows
        return self.num_partials > 0

    def item(self, i: int) -> tuple[int, ...]:
        """The ITEM_FIELDS values of item ``i`` (host-side, for tests and debugging)."""
        return tuple(self.items[i * ITEM_FIELDS : (i + 1) * ITEM_FIELDS])

    def row(self, d: int) -> tuple[int, ...]:
        """The ROW_FIELDS values of row ``d``."""
        return tuple(self.rows[d * ROW_FIELDS : (d + 1) * ROW_FIELDS])


def _target_items(num_kv_heads: int, num_sms: int, policy: DecodePolicy) -> int:
    return math.ceil(policy.programs_per_sm * num_sms / num_kv_heads)


def max_decode_items(num_rows: int, num_kv_heads: int, num_sms: int, policy: DecodePolicy | None = None) -> int:
    """Items any schedule of at most ``num_rows`` rows uses (with these heads, SMs, policy):
    the fixed grid (programs per KV head) of a CUDA graph captured for that bucket.

    Rows starting at 0 make fewer than ``R + T / c`` items of ``c`` tokens (T tokens in all).
    The balance keeps ``c >= balance * T / R``; a slot share ``s`` keeps ``c >= s * T / target``
    (``target`` = programs_per_sm * SMs / kv_heads, a wave of items), so at most ``R + target /
    s`` items whatever the lengths: with a slot share a large bucket's grid is the rows plus
    about one wave, not 1.8x the rows (128 rows on 132 SMs, 8 KV heads, 2 programs an SM, share 1.0: 161
    items a KV head, not 231). A graph replays every slot of the grid, and a slot past the step's
    items is a program that starts, reads its item and exits. Windowed rows (starts past 0) may
    need more; their chunks then grow until the items fit (:func:`schedule_decode`)."""
    policy = policy or DecodePolicy()
    _check_positive(num_kv_heads=num_kv_heads, num_sms=num_sms)
    if num_rows < 0:
        raise ValueError(f"num_rows: {num_rows} must be >= 0")
    target = _target_items(num_kv_heads, num_sms, policy)
    split = math.ceil(num_rows / policy.balance)
    if policy.slot_share:
        split = min(split, math.ceil(target / policy.slot_share))
    balanced = num_rows + split
    # Wave fill cuts only batches of [target, 2 x target) rows (one to two waves: _fill_waves).
    filled = WAVE_FILL_SPLITS * min(num_rows, 2 * target) if policy.wave_fill and num_rows >= target else 0
    return max(balanced, target, filled) if num_rows else 0


def max_decode_partials(
    num_rows: int,
    num_kv_heads: int,
    num_sms: int,
    policy: DecodePolicy | None = None,
    max_query_len: int = 1,
) -> int:
    """Partial-output slots any schedule of at most ``num_rows`` rows of at most
    ``max_query_len`` new tokens each uses.

    With I <= M items over R rows, s of them split: chunks of split rows = I - (R - s) and
    each split row has >= 2 chunks, so they are <= min(M, 2 * (M - R)); the maximum over
    R = 1..num_rows, times the tokens per row (each token of a split row has its own slots).
    """
    policy = policy or DecodePolicy()
    best = 0
    # The bound falls with R once M(R) = R; a few candidates suffice, but the loop is cheap
    # and obviously right.
    for r in range(1, num_rows + 1):
        m = max_decode_items(r, num_kv_heads, num_sms, policy)
        best = max(best, min(m, 2 * (m - r)))
    return best * max_query_len


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name}: {v} must be >= 1")


def _count_items(starts: list[int], ends: list[int], chunk_len: int, aligned: bool) -> int:
    """Items of ``chunk_len`` tokens the rows make: per row ``(e - 1) // c - s // c + 1``.
    ``aligned``: every start is 0 (the ``s // c`` terms vanish)."""
    c = chunk_len
    count = sum([(e - 1) // c for e in ends]) + len(ends)
    return count if aligned else count - sum([s // c for s in starts])


def _smallest_fitting(starts: list[int], ends: list[int], aligned: bool, budget: int, granule: int, lo: int) -> int:
    """A multiple of ``granule`` >= ``lo`` whose item count is <= budget (budget >= R: a
    chunk as long as the furthest kv_end gives every row one item): the smallest one when
    every row starts at 0 (counts then fall as chunks grow); with windows the bisection
    still only ever returns a fitting length.

    The search starts from bounds the counts imply: a row of n tokens needs >= n / c chunks,
    so c >= T / budget; a row starting at 0 needs <= n / c + 1, so when every row starts at
    0, c = T / (budget - R) always fits. Few count passes then: this runs every step.
    """
    total = sum(ends) - sum(starts)
    lo_k = max(1, -(-lo // granule), total // (budget * granule))
    hi_k = max(lo_k, -(-max(ends) // granule))
    if budget > len(ends) and aligned:
        hi_k = max(lo_k, min(hi_k, -(-total // ((budget - len(ends)) * granule))))
    if _count_items(starts, ends, lo_k * granule, aligned) <= budget:
        return lo_k * granule
    while hi_k - lo_k > 1:  # invariant: count(lo) > budget >= count(hi)
        mid = (lo_k + hi_k) // 2
        if _count_items(starts, ends, mid * granule, aligned) <= budget:
            hi_k = mid
        else:
            lo_k = mid
    return hi_k * granule


def _largest_with_at_least(
    starts: list[int], ends: list[int], aligned: bool, want: int, granule: int, lo: int, hi: int
) -> int:
    """Largest multiple of ``granule`` in [lo, hi] giving >= ``want`` items, else ``lo``."""
    lo_k, hi_k = max(1, -(-lo // granule)), max(1, hi // granule)
    if hi_k < lo_k or _count_items(starts, ends, lo_k * granule, aligned) < want:
        return lo_k * granule
    while hi_k > lo_k:  # invariant: count(lo) >= want
        mid = (lo_k + hi_k + 1) // 2
        if _count_items(starts, ends, mid * granule, aligned) >= want:
            lo_k = mid
        else:
            hi_k = mid - 1
    return lo_k * granule


def _choose_chunk_len(
    starts: list[int],
    ends: list[int],
    aligned: bool,
    budget: int,
    num_kv_heads: int,
    num_sms: int,
    block_n: int,
    policy: DecodePolicy,
) -> int:
    rows = len(ends)
    total = sum(ends) - sum(starts)
    longest_wanted = policy.balance * total / rows
    if policy.slot_share:  # a row within this share of a place's work stays whole
        place_tokens = total * num_kv_heads / (policy.programs_per_sm * num_sms)
        longest_wanted = max(longest_wanted, policy.slot_share * place_tokens)
    chunk = -(-math.ceil(longest_wanted) // block_n) * block_n
    target = _target_items(num_kv_heads, num_sms, policy)
    if rows < target:
        chunk = min(chunk, _smallest_fitting(starts, ends, aligned, target, block_n, block_n))
    floor = -(-policy.min_chunk_tokens // block_n) * block_n
    one_per_sm = math.ceil(num_sms / num_kv_heads)
    if _count_items(starts, ends, floor, aligned) < one_per_sm:
        # Too small a batch to give every SM a program at the usual floor: shorter chunks,
        # as long as possible while still reaching one program per SM.
        floor = _largest_with_at_least(
            starts, ends, aligned, one_per_sm, block_n, policy.small_batch_chunk_tokens, floor
        )
    chunk = max(chunk, floor)
    if policy.wave_fill and rows >= target:
        chunk = _fill_waves(starts, ends, aligned, budget, num_kv_heads, num_sms, block_n, floor, chunk, policy)
    if _count_items(starts, ends, chunk, aligned) <= budget:
        return chunk
    # Only windowed rows get here: with unaligned starts a longer chunk can even give more
    # items (a row may straddle one more boundary), so search up from here for one that fits.
    return _smallest_fitting(starts, ends, aligned, budget, block_n, chunk)


def _fill_waves(
    starts: list[int],
    ends: list[int],
    aligned: bool,
    budget: int,
    num_kv_heads: int,
    num_sms: int,
    block_n: int,
    floor: int,
    chunk: int,
    policy: DecodePolicy,
) -> int:
    """``chunk``, or a shorter one that cuts each row into 2..WAVE_FILL_SPLITS pieces when
    the rows are near-equal, unsplit, and their programs leave the last wave of the launch
    less than ``policy.wave_fill`` full (DecodePolicy). Programs of unequal rows end at
    different times, so counting them says nothing about the waves: those keep ``chunk``."""
    lengths = list(map(sub, ends, starts))
    longest = max(lengths)
    if longest > chunk or 4 * min(lengths) < 3 * longest:
        return chunk
    places = policy.programs_per_sm * num_sms

    def fill(items: int) -> float:
        """How full the waves of ``items`` x KV heads programs are."""
        programs = items * num_kv_heads
        return programs / (-(-programs // places) * places)

    items = _count_items(starts, ends, chunk, aligned)
    # Two waves or more stay whole: cutting lost 10-25% at 2.6 and 5.2 (see DecodePolicy).
    if items * num_kv_heads >= 2 * places or fill(items) >= policy.wave_fill:
        return chunk
    for pieces in range(2, WAVE_FILL_SPLITS + 1):
        cut = -(-longest // (pieces * block_n)) * block_n
        items = _count_items(starts, ends, cut, aligned)
        if cut < floor or items > budget:
            break
        if fill(items) >= policy.wave_fill:
            return cut
    return chunk


def _check_ranges(kv_ranges: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The rows' kv_start and kv_end values as two lists of ints, after checking every range
    (C-speed passes; the element-by-element search only to name a bad one)."""
    try:
        flat = array("q", chain.from_iterable(kv_ranges))
    except (TypeError, ValueError, OverflowError):
        flat = None
    if flat is not None and len(flat) == 2 * len(kv_ranges):
        starts, ends = flat[0::2].tolist(), flat[1::2].tolist()
        if (not starts or (min(starts) >= 0 and max(ends) <= _INT32_MAX)) and all(map(lt, starts, ends)):
            return starts, ends
    for d, pair in enumerate(kv_ranges):
        try:
            s, e = (index(v) for v in pair)
        except (TypeError, ValueError):
            raise ValueError(f"kv_ranges[{d}]: {pair!r:.60} must be a pair of integers (kv_start, kv_end)") from None
        if not 0 <= s < e <= _INT32_MAX:
            raise ValueError(
                f"kv_ranges[{d}]: ({s}, {e}) must satisfy 0 <= kv_start < kv_end <= {_INT32_MAX} (a decode "
                f"row attends at least its own new token; the kernel's positions are int32)"
            )
    raise ValueError("kv_ranges: every entry must be a pair of integers (kv_start, kv_end)")


def _per_row(name: str, values: Sequence[int] | None, num_rows: int) -> list[int]:
    if values is None:
        return list(range(num_rows))
    if len(values) != num_rows:
        raise ValueError(f"{name}: {len(values)} entries for {num_rows} rows; give one per kv_range")
    try:
        out = array("q", values).tolist()
    except (TypeError, OverflowError):
        raise ValueError(f"{name}: entries must be integers in int64 range, got {list(values)!r:.80}") from None
    if out and min(out) < 0:
        raise ValueError(f"{name}: entries must be >= 0, got {min(out)}")
    if out and max(out) > _INT32_MAX:
        raise ValueError(f"{name}: entries must be <= {_INT32_MAX} (the kernel reads int32), got {max(out)}")
    return out


def schedule_decode(
    kv_ranges: Sequence[tuple[int, int]],
    *,
    num_kv_heads: int,
    num_sms: int,
    block_n: int,
    max_items: int | None = None,
    max_rows: int | None = None,
    policy: DecodePolicy | None = None,
    chunk_len: int | None = None,
    table_rows: Sequence[int] | None = None,
    q_tokens: Sequence[int] | None = None,
    q_lens: Sequence[int] | None = None,
    max_query_len: int | None = None,
) -> DecodeSchedule:
    """Partition decode rows into items of one chunk length.

    kv_ranges:  per decode row d, ``(kv_start, kv_end)``: the K/V token positions it attends
                (``0 <= kv_start < kv_end``; kv_start > 0 for sliding windows).
    num_kv_heads, num_sms: programs are (item x KV head); the GPU has num_sms SMs.
    block_n:    the kernel's tile (tokens); chunk_len is a multiple of it.
    max_items:  fixed grid for a CUDA graph (>= len(kv_ranges); see max_decode_items): the
                chunk grows until the items fit, and the item array is padded to it.
    max_rows:   rows the combine step covers on a fixed grid (>= len(kv_ranges)); default
                len(kv_ranges). Pass the bucket's row count when capturing a graph.
    policy:     see DecodePolicy. chunk_len: force this chunk length (rounded up to a
                multiple of block_n, grown if the items would not fit); tests and sweeps.
    table_rows, q_tokens: per row, the block-table row it reads and the first query/output
                token it owns (default: row d uses table row d and token d).
    q_lens:     per row, its new tokens (1 .. MAX_DECODE_QUERY_LEN; default 1): tokens
                q_tokens[d] .. q_tokens[d] + q_lens[d] - 1, at the last q_lens[d] positions
                of its range.
    max_query_len: compile the launch for rows of up to this many new tokens (a power of
                two, a CUDA-graph bucket's fixed choice); default: the smallest that fits.

    Items are ordered heaviest first (more tokens first; ties by row, then position), so the
    longest programs start first and the launch's tail is short. Rows with one chunk get
    partial_slot -1; a row with k > 1 chunks owns slots first_partial .. first_partial + k - 1.
    Raises ValueError naming the argument for an empty or negative range, a max_items below
    the row count, inconsistent per-row lists, or query lengths out of range.
    """
    policy = policy or DecodePolicy()
    _check_positive(num_kv_heads=num_kv_heads, num_sms=num_sms, block_n=block_n)
    starts, ends = _check_ranges(kv_ranges)
    num_rows = len(ends)
    tables, tokens = _per_row("table_rows", table_rows, num_rows), _per_row("q_tokens", q_tokens, num_rows)
    lens = [1] * num_rows if q_lens is None else _per_row("q_lens", q_lens, num_rows)
    query_len = _query_len(starts, ends, lens, max_query_len)
    if max_items is not None and max_items < num_rows:
        raise ValueError(
            f"max_items: {max_items} is below the {num_rows} rows (each row needs >= 1 item); "
            f"use max_decode_items({num_rows}, ...)"
        )
    if max_rows is not None and max_rows < num_rows:
        raise ValueError(f"max_rows: {max_rows} is below the {num_rows} rows scheduled")
    if chunk_len is not None and chunk_len < 1:
        raise ValueError(f"chunk_len: {chunk_len} must be >= 1 (or None to choose)")
    budget = max_decode_items(num_rows, num_kv_heads, num_sms, policy)
    if max_items is not None:
        budget = min(budget, max_items)
    aligned = not any(starts)
    if not num_rows:
        chunk = block_n
    elif chunk_len is not None:
        chunk = _smallest_fitting(starts, ends, aligned, budget, block_n, chunk_len)
    else:
        chunk = _choose_chunk_len(starts, ends, aligned, budget, num_kv_heads, num_sms, block_n, policy)
    return _build(starts, ends, tables, tokens, lens, query_len, chunk, block_n, max_items, max_rows)


def _query_len(starts: list[int], ends: list[int], lens: list[int], max_query_len: int | None) -> int:
    """The launch's tokens per row (a power of two), after checking every row's q_len."""
    longest = max(lens, default=1)
    in_range = not lens or (min(lens) >= 1 and longest <= MAX_DECODE_QUERY_LEN)
    # Every range holds >= 1 token (checked), so rows of one token always fit in theirs.
    if not in_range or (longest > 1 and not all(map(le, lens, map(sub, ends, starts)))):
        for d, (q, s, e) in enumerate(zip(lens, starts, ends, strict=True)):
            if not 1 <= q <= min(MAX_DECODE_QUERY_LEN, e - s):
                raise ValueError(
                    f"q_lens[{d}]: {q} must be in [1, {MAX_DECODE_QUERY_LEN}] and within its kv range ({s}, {e}); "
                    f"longer rows go to the prefill kernel"
                )
    if max_query_len is None:
        return 1 << (longest - 1).bit_length()
    if max_query_len < longest or max_query_len > MAX_DECODE_QUERY_LEN or max_query_len & (max_query_len - 1):
        raise ValueError(
            f"max_query_len: {max_query_len} must be a power of two in [{longest} (the longest row), "
            f"{MAX_DECODE_QUERY_LEN}]"
        )
    return max_query_len


def _build(
    starts: list[int],
    ends: list[int],
    tables: list[int],
    tokens: list[int],
    lens: list[int],
    query_len: int,
    chunk: int,
    block_n: int,
    max_items: int | None,
    max_rows: int | None,
) -> DecodeSchedule:
    """The item and row arrays for one chunk length. Each item is packed to its int32 bytes
    as it is made (one C call), then the packed items are joined heaviest first: a stable
    sort on the negated token count keeps ties in the order they were made, by row, then
    position."""
    num_rows = len(ends)
    grid_rows = num_rows if max_rows is None else max_rows
    pack_item, pack_row = _ITEM.pack, _ROW.pack
    packed_rows: list[bytes] = []
    packed_items: list[bytes] = []
    weights: list[int] = []  # per item, minus its tokens
    next_slot = 0
    for d, s, e, table_row, q_token, q_len in zip(range(num_rows), starts, ends, tables, tokens, lens, strict=True):
        first_j, last_j = s // chunk, (e - 1) // chunk
        if first_j == last_j:
            packed_rows.append(pack_row(table_row, q_token, 1, -1, q_len))
            packed_items.append(pack_item(d, s, e, -1, table_row, q_token, 1, -1, q_len, e))
            weights.append(s - e)
            continue
        n = last_j - first_j + 1
        packed_rows.append(pack_row(table_row, q_token, n, next_slot, q_len))
        for j in range(first_j, last_j + 1):
            a, b = max(s, j * chunk), min(e, (j + 1) * chunk)
            packed_items.append(pack_item(d, a, b, next_slot + j - first_j, table_row, q_token, n, next_slot, q_len, e))
            weights.append(a - b)
        next_slot += n * q_len
    num_items = len(packed_items)
    grid_items = num_items if max_items is None else max_items
    if num_items > grid_items:  # max_decode_items bounds every schedule; a bug if not
        raise RuntimeError(f"scheduler made {num_items} items for a grid of {grid_items}")
    order = sorted(range(num_items), key=weights.__getitem__)
    items = array("i", b"".join(map(packed_items.__getitem__, order)))
    items.frombytes(_PACKED_PAD_ITEM * (grid_items - num_items))
    rows = array("i", b"".join(packed_rows))
    rows.frombytes(_PACKED_PAD_ROW * (grid_rows - num_rows))
    return DecodeSchedule(
        chunk_len=chunk,
        block_n=block_n,
        num_rows=num_rows,
        num_items=num_items,
        grid_items=grid_items,
        grid_rows=grid_rows,
        query_len=query_len,
        num_partials=next_slot,
        items=items,
        rows=rows,
        fixed_grid=max_items is not None,
        max_table_row=max(tables, default=-1),
        max_q_token=max(map(sub, map(add, tokens, lens), [1] * num_rows), default=-1),
    )
