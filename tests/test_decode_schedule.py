"""The decode scheduler (pure Python): coverage, chunk lengths, fixed grids, its decisions on
the benchmark's shapes, and its argument errors."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.triton_kernels.decode_schedule import (
    ITEM_FIELDS,
    PAD_ITEM,
    PAD_ROW,
    WAVE_FILL_SPLITS,
    DecodePolicy,
    DecodeSchedule,
    _choose_chunk_len,
    max_decode_items,
    max_decode_partials,
    schedule_decode,
)

H200_SMS = 132


def _lognormal(n: int, median: int, sigma: float, cap: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def _check_invariants(
    s: DecodeSchedule, ranges: list[tuple[int, int]], policy: DecodePolicy, q_lens: list[int] | None = None
) -> None:
    """Every token of every row in exactly one item; items heaviest first; partial slots
    unique, contiguous per split row (one run of chunks per new token), and absent for
    one-chunk rows; padding in place."""
    q_lens = q_lens or [1] * len(ranges)
    assert s.chunk_len % s.block_n == 0
    assert s.num_items <= s.grid_items and s.num_rows == len(ranges) <= s.grid_rows
    assert s.query_len >= max(q_lens, default=1) and s.query_len & (s.query_len - 1) == 0
    covered: dict[int, list[tuple[int, int]]] = {d: [] for d in range(len(ranges))}
    slots: list[int] = []
    sizes = []
    for i in range(s.num_items):
        d, a, b, slot, table_row, q_token, n, first, q_len, row_end = s.item(i)
        assert s.row(d) == (table_row, q_token, n, first, q_len)
        assert q_len == q_lens[d] and row_end == ranges[d][1]
        assert a < b and b - a <= s.chunk_len
        assert a // s.chunk_len == (b - 1) // s.chunk_len, "an item crosses a chunk boundary"
        covered[d].append((a, b))
        sizes.append(b - a)
        if n == 1:
            assert slot == -1 and first == -1
        else:
            assert first <= slot < first + n
            slots += [slot + t * n for t in range(q_len)]
    assert sizes == sorted(sizes, reverse=True), "items are not heaviest first"
    for d, (start, end) in enumerate(ranges):
        pieces = sorted(covered[d])
        assert pieces[0][0] == start and pieces[-1][1] == end
        assert all(p[1] == q[0] for p, q in itertools.pairwise(pieces)), f"row {d}: gap or overlap"
        assert s.row(d)[2] == len(pieces)
    assert sorted(slots) == list(range(s.num_partials)), "partial slots are not unique and dense"
    for i in range(s.num_items, s.grid_items):
        assert s.item(i) == PAD_ITEM
    for d in range(s.num_rows, s.grid_rows):
        assert s.row(d) == PAD_ROW


lengths = st.lists(
    st.one_of(st.integers(1, 40), st.integers(1, 5000), st.integers(100_000, 3_000_000)), min_size=0, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(
    lens=lengths,
    starts=st.lists(st.integers(0, 3000), min_size=40, max_size=40),
    kv_heads=st.sampled_from([1, 2, 8, 16]),
    sms=st.sampled_from([1, 16, 132]),
    block_n=st.sampled_from([16, 32, 64, 128]),
    policy=st.sampled_from(
        [
            DecodePolicy(),
            DecodePolicy(4, 1.0, 128, 32),
            DecodePolicy(1, 0.3, 512, 512),
            DecodePolicy(2, slot_share=1.0),
            DecodePolicy(2, slot_share=0.25, wave_fill=0.9),
            DecodePolicy(3, slot_share=4.0),
        ]
    ),
    windowed=st.booleans(),
    queries=st.lists(st.integers(1, 8), min_size=40, max_size=40),
    multi=st.booleans(),
)
def test_schedule_invariants_and_fixed_grid_bounds(
    lens: list[int],
    starts: list[int],
    kv_heads: int,
    sms: int,
    block_n: int,
    policy: DecodePolicy,
    windowed: bool,
    queries: list[int],
    multi: bool,
) -> None:
    ranges = [(starts[i] if windowed else 0, (starts[i] if windowed else 0) + n) for i, n in enumerate(lens)]
    q_lens = [min(q, n) if multi else 1 for q, n in zip(queries, lens, strict=False)]
    # Rows of several new tokens own consecutive query tokens.
    tokens = [sum(q_lens[:i]) for i in range(len(q_lens))]
    common = {"q_lens": q_lens, "q_tokens": tokens}
    free = schedule_decode(ranges, num_kv_heads=kv_heads, num_sms=sms, block_n=block_n, policy=policy, **common)
    _check_invariants(free, ranges, policy, q_lens)
    assert free.max_q_token == sum(q_lens) - 1
    # Fixed grid of a bucket with more rows than this step: the same items, padded.
    bucket = len(ranges) + 3
    cap_items = max_decode_items(bucket, kv_heads, sms, policy)
    fixed = schedule_decode(
        ranges,
        num_kv_heads=kv_heads,
        num_sms=sms,
        block_n=block_n,
        policy=policy,
        max_items=cap_items,
        max_rows=bucket,
        max_query_len=8,
        **common,
    )
    _check_invariants(fixed, ranges, policy, q_lens)
    assert fixed.grid_items == cap_items and fixed.grid_rows == bucket and fixed.query_len == 8
    assert fixed.num_partials <= max_decode_partials(bucket, kv_heads, sms, policy, max_query_len=8)
    if not multi:
        assert fixed.num_partials <= max_decode_partials(bucket, kv_heads, sms, policy)
    assert free.num_items <= max_decode_items(len(ranges), kv_heads, sms, policy)
    if ranges and not windowed:  # rows from 0: the bounds never bind, the policy's chunk stands
        unbounded = _choose_chunk_len([0] * len(lens), lens, True, 1 << 40, kv_heads, sms, block_n, policy)
        assert free.chunk_len == fixed.chunk_len == unbounded
    # A tight grid (one item per row) never splits; the chunk grows until the items fit.
    tight = schedule_decode(
        ranges, num_kv_heads=kv_heads, num_sms=sms, block_n=block_n, max_items=len(ranges), **common
    )
    _check_invariants(tight, ranges, policy, q_lens)
    assert tight.num_items == len(ranges) and tight.num_partials == 0
    if ranges and not windowed:
        # Chunks respect the floor, or the small-batch floor when the batch cannot give every
        # SM a program at the usual one.
        small = -(-policy.small_batch_chunk_tokens // block_n) * block_n
        assert free.chunk_len >= small
        floor = -(-policy.min_chunk_tokens // block_n) * block_n
        if sum(-(-e // floor) for _, e in ranges) >= math.ceil(sms / kv_heads):
            assert free.chunk_len >= floor


def test_max_decode_partials_is_a_bound_over_smaller_batches() -> None:
    """Brute force: for every batch of up to B rows, no schedule on B's grid uses more."""
    rng = random.Random(1)
    for bucket in (1, 2, 5, 40):
        limit = max_decode_partials(bucket, 8, H200_SMS)
        cap = max_decode_items(bucket, 8, H200_SMS)
        for _ in range(30):
            rows = rng.randint(1, bucket)
            lens = [rng.choice([1, 100, 5000, 200_000]) for _ in range(rows)]
            s = schedule_decode([(0, n) for n in lens], num_kv_heads=8, num_sms=H200_SMS, block_n=64, max_items=cap)
            assert s.num_partials <= limit


def test_fixed_grid_sizes_depend_only_on_rows() -> None:
    assert max_decode_items(1, 8, H200_SMS) == 50  # 3 programs per SM x 132 SMs / 8 KV heads
    assert max_decode_items(64, 8, H200_SMS) == 116  # 64 rows + 64 / balance 1.25
    assert max_decode_items(0, 8, H200_SMS) == 0
    # A slot share s caps the splits at programs_per_sm x SMs / (KV heads x s): 2 x 132 / 8 = 33.
    assert max_decode_items(128, 8, H200_SMS, DecodePolicy(2)) == 128 + 103  # 128 / 1.25, no share
    assert max_decode_items(128, 8, H200_SMS, DecodePolicy(2, slot_share=1.0)) == 128 + 33
    assert max_decode_items(128, 8, H200_SMS, DecodePolicy(2, slot_share=0.75)) == 128 + 44
    assert max_decode_items(16, 8, H200_SMS, DecodePolicy(2, slot_share=1.0)) == 33  # the target: one wave
    assert max_decode_items(20, 8, H200_SMS, DecodePolicy(2, slot_share=4.0)) == 33  # 20 + 9 < the target
    assert max_decode_partials(1, 8, H200_SMS) == 50 and max_decode_partials(0, 8, H200_SMS) == 0


def test_a_slot_share_grid_holds_the_burst_with_fewer_padding_programs() -> None:
    """The end-to-end burst's decode step (128 rows of LogNormal(550) tokens, 8 KV heads, 2 x 132
    places) on its bucket's grid: every item fits the slot-share bound, which pads 33 slots a KV
    head past the rows where the share-blind bound padded 103, and the schedule is the one made
    without a fixed grid."""
    lens = _lognormal(128, 550, 0.6, 2048)
    ranges = [(0, n) for n in lens]
    for share, grid in ((1.0, 161), (0.75, 172)):
        policy = DecodePolicy(2, slot_share=share)
        assert max_decode_items(len(lens), 8, H200_SMS, policy) == grid
        free = schedule_decode(ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128, policy=policy)
        fixed = schedule_decode(
            ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128, policy=policy, max_items=grid, max_rows=128
        )
        _check_invariants(fixed, ranges, policy)
        assert fixed.grid_items == grid and fixed.chunk_len == free.chunk_len
        assert fixed.num_items == free.num_items <= grid
        assert fixed.items[: free.num_items * ITEM_FIELDS] == free.items


@pytest.mark.parametrize(
    ("lens", "chunk_len", "items"),
    [
        ([4096] * 64, None, 64),  # 512 programs fill the GPU: whole rows, one launch
        ([1024] * 256, None, 256),
        ([1000 + i for i in range(256)], None, 256),  # near-uniform rows do not split either
        ([512] * 32, None, 32),  # 256 programs: whole rows
        ([16384] * 16, 5504, 48),  # 128 programs would be too few: three chunks per row (384)
        ([32768], 704, 47),  # one long row: 47 chunks x 8 KV heads = 376 programs (~3 per SM)
        ([1024], 64, 16),  # latency-bound: below the 256-token floor to reach ~1 program/SM
        ([512] * 8, 192, 24),
    ],
)
def test_h200_decisions_on_the_benchmark_shapes(lens: list[int], chunk_len: int | None, items: int) -> None:
    """chunk_len None: every row stays whole (one item each, no combine launch)."""
    s = schedule_decode([(0, n) for n in lens], num_kv_heads=8, num_sms=H200_SMS, block_n=64)
    assert s.num_items == items and s.needs_combine == (items > len(lens))
    if chunk_len is None:
        assert s.chunk_len >= max(lens) and s.num_partials == 0
    else:
        assert s.chunk_len == chunk_len


def _waves_full(s: DecodeSchedule, kv_heads: int, places: int) -> float:
    programs = s.num_items * kv_heads
    return programs / (math.ceil(programs / places) * places)


@pytest.mark.parametrize(
    ("lens", "pieces"),
    [
        ([4096] * 64, 3),  # 512 programs for 396 places (65% full) -> 1,536 (97%)
        ([4000 + 7 * i for i in range(64)], 3),  # near-equal rows count as equal
        ([3000] * 80, 3),  # 640 (81%) -> 1,280 (81%) -> 1,920 (97%)
    ],
)
def test_wave_fill_cuts_near_equal_rows_until_the_waves_are_full(lens: list[int], pieces: int) -> None:
    """64 rows x 8 KV heads leave the second wave of a 396-place launch mostly idle; with
    wave_fill 0.9 every row is cut into the fewest pieces that fill 90% of the waves, on a
    free and on a CUDA graph's fixed grid alike. Without it the rows stay whole."""
    assert pieces <= WAVE_FILL_SPLITS
    ranges = [(0, n) for n in lens]
    policy = DecodePolicy(wave_fill=0.9)
    plain = schedule_decode(ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128)
    assert plain.num_items == len(lens) and _waves_full(plain, 8, 3 * H200_SMS) < 0.9
    free = schedule_decode(ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128, policy=policy)
    _check_invariants(free, ranges, policy)
    assert all(free.row(d)[2] == pieces for d in range(len(lens))), free.chunk_len
    assert _waves_full(free, 8, 3 * H200_SMS) >= 0.9 and free.chunk_len % 128 == 0
    bucket = len(lens) + 5
    fixed = schedule_decode(
        ranges,
        num_kv_heads=8,
        num_sms=H200_SMS,
        block_n=128,
        policy=policy,
        max_items=max_decode_items(bucket, 8, H200_SMS, policy),
        max_rows=bucket,
    )
    _check_invariants(fixed, ranges, policy)
    assert fixed.items[: free.num_items * 10] == free.items[: free.num_items * 10]
    assert fixed.num_partials == free.num_partials <= max_decode_partials(bucket, 8, H200_SMS, policy)


@pytest.mark.parametrize(
    "lens",
    [
        _lognormal(64, 2048, 0.8, 16384),  # unequal rows: counts say nothing about the waves
        [4096] * 32 + [2000] * 32,  # the shortest under 3/4 of the longest
        [16384] * 16,  # too few rows for one wave: parallelism splits them, as before
        [4096] * 99,  # 792 programs: exactly two full waves
        [2048] * 128,  # 1,024 programs (2.6 waves, 86% full): two waves or more stay whole
        [1024] * 256,
        [8000] * 55,  # 440 programs (56%): 2 or 3 pieces fill only 74% / 83%
        [300] * 64,  # pieces would fall under the 256-token floor
    ],
)
def test_wave_fill_leaves_other_batches_as_they_were(lens: list[int]) -> None:
    ranges = [(0, n) for n in lens]
    plain = schedule_decode(ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128)
    filled = schedule_decode(ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128, policy=DecodePolicy(wave_fill=0.9))
    assert (filled.chunk_len, filled.items) == (plain.chunk_len, plain.items)


@settings(max_examples=150, deadline=None)
@given(
    base=st.integers(1, 20_000),
    jitter=st.lists(st.integers(0, 200), min_size=1, max_size=120),
    start=st.integers(0, 3000),
    kv_heads=st.sampled_from([1, 2, 8]),
    sms=st.sampled_from([1, 4, 16, 132]),
    block_n=st.sampled_from([16, 64, 128]),
    fill=st.sampled_from([0.5, 0.9, 1.0]),
    spare=st.integers(0, 40),
)
def test_wave_fill_keeps_the_invariants_and_the_graph_bounds(
    base: int, jitter: list[int], start: int, kv_heads: int, sms: int, block_n: int, fill: float, spare: int
) -> None:
    """Near-equal rows (where wave fill acts), windowed or not: every token in one item, and
    a bucket's fixed grid and partial slots hold whatever it cuts."""
    policy = DecodePolicy(wave_fill=fill, min_chunk_tokens=64, small_batch_chunk_tokens=16)
    for s0 in (0, start):
        ranges = [(s0, s0 + base + j) for j in jitter]
        bucket = len(ranges) + spare
        free = schedule_decode(ranges, num_kv_heads=kv_heads, num_sms=sms, block_n=block_n, policy=policy)
        _check_invariants(free, ranges, policy)
        assert free.num_items <= max_decode_items(len(ranges), kv_heads, sms, policy)
        fixed = schedule_decode(
            ranges,
            num_kv_heads=kv_heads,
            num_sms=sms,
            block_n=block_n,
            policy=policy,
            max_items=max_decode_items(bucket, kv_heads, sms, policy),
            max_rows=bucket,
        )
        _check_invariants(fixed, ranges, policy)
        assert fixed.num_partials <= max_decode_partials(bucket, kv_heads, sms, policy)


def test_slot_share_keeps_rows_within_a_slots_share_whole() -> None:
    """128 rows of LogNormal(550) tokens on 8 KV heads and 2 x 132 places: a place's share of
    the step is ~2,500 tokens, so with slot_share 1.0 no row splits (balance alone cuts every
    row over 1.25 x the mean); 0.5 cuts only rows over ~1,250 tokens, and chunks are never
    shorter than the policy without a share would make them."""
    lens = _lognormal(128, 550, 0.6, 2048)
    ranges = [(0, n) for n in lens]
    share_tokens = sum(lens) * 8 / (2 * H200_SMS)
    plain = schedule_decode(ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128, policy=DecodePolicy(2))
    assert plain.num_items > len(lens)  # balance alone splits the long rows
    for share in (0.5, 1.0):
        policy = DecodePolicy(2, slot_share=share)
        s = schedule_decode(ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128, policy=policy)
        _check_invariants(s, ranges, policy)
        assert s.chunk_len >= max(plain.chunk_len, share * share_tokens)
        assert s.chunk_len - 128 < max(plain.chunk_len, share * share_tokens)  # the next tile up, no more
        split = [n for d, n in enumerate(lens) if s.row(d)[2] > 1]
        assert all(n > share * share_tokens for n in split)
        assert (not split) == (max(lens) <= s.chunk_len)
    assert schedule_decode(ranges, num_kv_heads=8, num_sms=H200_SMS, block_n=128,
                           policy=DecodePolicy(2, slot_share=1.0)).num_items == len(lens)  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(
    lens=st.lists(st.integers(1, 30_000), min_size=1, max_size=200),
    long=st.one_of(st.just(0), st.integers(100_000, 3_000_000)),
    start=st.integers(0, 3000),
    kv_heads=st.sampled_from([1, 8]),
    sms=st.sampled_from([4, 132]),
    share=st.sampled_from([0.25, 1.0, 4.0]),
    spare=st.integers(0, 40),
)
def test_slot_share_keeps_the_invariants_and_the_graph_bounds(
    lens: list[int], long: int, start: int, kv_heads: int, sms: int, share: float, spare: int
) -> None:
    """Longer chunks only lower the item count: a bucket's fixed grid and partial slots, sized
    without the share or with it, hold every schedule it makes (windowed rows too); for rows
    from 0 the share's tighter grid never binds (the chunk is the policy's own). One row far
    longer than the rest (``long``) splits into about a wave of items: the bound's worst case."""
    policy = DecodePolicy(slot_share=share)
    lens = [*lens, long] if long else lens
    for s0 in (0, start):
        ranges = [(s0, s0 + n) for n in lens]
        bucket = len(ranges) + spare
        for sizing in (DecodePolicy(), policy):
            fixed = schedule_decode(
                ranges,
                num_kv_heads=kv_heads,
                num_sms=sms,
                block_n=64,
                policy=policy,
                max_items=max_decode_items(bucket, kv_heads, sms, sizing),
                max_rows=bucket,
            )
            _check_invariants(fixed, ranges, policy)
            assert fixed.num_partials <= max_decode_partials(bucket, kv_heads, sms, sizing)
            if s0 == 0:
                unbounded = _choose_chunk_len([0] * len(lens), lens, True, 1 << 40, kv_heads, sms, 64, policy)
                assert fixed.chunk_len == unbounded


@pytest.mark.parametrize("share", [-0.1, 4.5, float("nan")])
def test_bad_slot_share_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="slot_share"):
        DecodePolicy(slot_share=share)


def test_lognormal_batch_splits_only_its_long_rows() -> None:
    """Rows of very different lengths: the long ones are cut so no program reads much more
    than the typical row, the short ones stay whole (no combine work for them)."""
    lens = _lognormal(64, 2048, 0.8, 16384)
    s = schedule_decode([(0, n) for n in lens], num_kv_heads=8, num_sms=H200_SMS, block_n=64)
    assert len(lens) < s.num_items <= max_decode_items(64, 8, H200_SMS)
    assert s.chunk_len < max(lens) // 2 and s.chunk_len >= sorted(lens)[len(lens) // 2]
    split_rows = [d for d in range(64) if s.row(d)[2] > 1]
    assert split_rows and all(lens[d] > s.chunk_len for d in split_rows)
    assert s.item(0)[2] - s.item(0)[1] == s.chunk_len  # a full chunk of a long row goes first


def test_window_chunks_sit_on_absolute_boundaries() -> None:
    s = schedule_decode([(100, 700), (5, 6)], num_kv_heads=1, num_sms=8, block_n=64, chunk_len=256)
    assert s.chunk_len == 256
    pieces = sorted(s.item(i)[:3] for i in range(s.num_items))
    assert pieces == [(0, 100, 256), (0, 256, 512), (0, 512, 700), (1, 5, 6)]
    assert s.row(0)[2:4] == (3, 0) and s.row(1)[2:4] == (1, -1)


def test_per_row_table_rows_and_tokens() -> None:
    s = schedule_decode([(0, 10), (0, 20)], num_kv_heads=2, num_sms=4, block_n=16, table_rows=[7, 3], q_tokens=[40, 2])
    assert s.row(0)[:2] == (7, 40) and s.row(1)[:2] == (3, 2)
    assert (s.max_table_row, s.max_q_token) == (7, 40)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_ranges": [(0, 5), (3, 3)]}, r"kv_ranges\[1\]: \(3, 3\) must satisfy"),
        ({"kv_ranges": [(-1, 5)]}, r"kv_ranges\[0\]"),
        ({"kv_ranges": [(0, 5), (0.5, 9)]}, r"kv_ranges\[1\]: \(0.5, 9\) must be a pair of integers"),
        ({"kv_ranges": [(0, 5), (0, 1, 9)]}, r"kv_ranges\[1\]: \(0, 1, 9\) must be a pair of integers"),
        ({"kv_ranges": [(0, 5), (0, 1 << 70)]}, r"kv_ranges\[1\]: \(0, 1180591620717411303424\) must satisfy"),
        ({"kv_ranges": [(0, 5), (0, 1 << 31)]}, r"kv_ranges\[1\]: .* <= 2147483647"),
        ({"table_rows": [0, 1.5]}, "table_rows: entries must be integers in int64 range"),
        ({"q_tokens": [0, 1 << 31]}, "q_tokens: entries must be <= 2147483647"),
        ({"max_items": 1}, "max_items: 1 is below the 2 rows"),
        ({"max_rows": 1}, "max_rows: 1 is below the 2 rows"),
        ({"table_rows": [0]}, "table_rows: 1 entries for 2 rows"),
        ({"q_tokens": [0, -2]}, "q_tokens: entries must be >= 0"),
        ({"block_n": 0}, "block_n: 0 must be >= 1"),
        ({"chunk_len": 0}, "chunk_len: 0 must be >= 1"),
        ({"q_lens": [1, 9]}, r"q_lens\[1\]: 9 must be in \[1, 8\]"),
        ({"q_lens": [6, 1]}, r"q_lens\[0\]: 6 must be in \[1, 8\] and within its kv range \(0, 5\)"),
        ({"q_lens": [0, 1]}, r"q_lens: entries must be >= 0|q_lens\[0\]: 0 must be"),
        ({"q_lens": [3, 3], "max_query_len": 2}, r"max_query_len: 2 must be a power of two in \[3"),
        ({"q_lens": [3, 3], "max_query_len": 6}, "max_query_len: 6 must be a power of two"),
        ({"max_query_len": 16}, "max_query_len: 16 must be a power of two in"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"kv_ranges": [(0, 5), (0, 9)], "num_kv_heads": 2, "num_sms": 4, "block_n": 16}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        schedule_decode(**args)  # type: ignore[arg-type]


def test_multi_token_rows_own_a_run_of_slots_per_token() -> None:
    """A split row of 3 new tokens over 3 chunks owns 9 slots: token t's chunks at first + 3t."""
    s = schedule_decode(
        [(0, 700), (0, 40)], num_kv_heads=1, num_sms=8, block_n=64, chunk_len=256, q_lens=[3, 2], q_tokens=[0, 3]
    )
    assert s.query_len == 4 and s.num_partials == 9 and s.max_q_token == 4
    assert s.row(0) == (0, 0, 3, 0, 3) and s.row(1) == (1, 3, 1, -1, 2)
    firsts = sorted(s.item(i)[3] for i in range(s.num_items) if s.item(i)[0] == 0)
    assert firsts == [0, 1, 2]  # chunk j of token 0; token t adds t * 3
    assert all(s.item(i)[9] == (700 if s.item(i)[0] == 0 else 40) for i in range(s.num_items))


def test_policy_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="programs_per_sm"):
        DecodePolicy(programs_per_sm=0)
    with pytest.raises(ValueError, match="small_batch_chunk_tokens"):
        DecodePolicy(min_chunk_tokens=32, small_batch_chunk_tokens=64)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"DecodePolicy\.wave_fill"):
            DecodePolicy(wave_fill=bad)
