"""The balanced MLA decode schedule (attention.triton_kernels.mla_balanced): the host plan's
invariants, and the kernels on it against the float64 reference (in Triton's CPU interpreter
without a GPU: small shapes; the cache holds NaN in every slot no row owns, see
tests/test_mla_decode.py)."""

from __future__ import annotations

import random

import pytest
import torch

from attention.errors import InvalidArgumentError
from attention.triton_kernels.mla_balanced import (
    DIRECT_STORE_BYTES,
    SEGMENT_COST_LATENTS,
    MLAWork,
    mla_direct_store,
    mla_work_len,
    mla_work_programs,
    mla_work_slots,
    plan_mla_work,
)
from attention.triton_kernels.mla_decode import causal_queries, mla_attention
from tests.test_mla_decode import DEVICE, _case, _reference

pytestmark = pytest.mark.kernel


def _decode(work: list[int], tokens: int, programs: int):  # type: ignore[no-untyped-def]
    """(cu, programs as (first tile, end tile, first token, last token, first slot), token slots)."""
    cu = work[: tokens + 1]
    prog = [tuple(work[tokens + 1 + 5 * p : tokens + 6 + 5 * p]) for p in range(programs)]
    slots = [tuple(work[tokens + 1 + 5 * programs + 2 * t : tokens + 3 + 5 * programs + 2 * t]) for t in range(tokens)]
    return cu, prog, slots


def _costs(cu: list[int], ranges: list[tuple[int, int]], block_n: int) -> list[int]:
    """Each range's cost as the plan counts it: tiles, plus the segment cost (in tiles) for
    every token with tiles it touches after its first."""
    segment = max(1, SEGMENT_COST_LATENTS // block_n)
    costs = []
    for first, end in ranges:
        touched = sum(1 for t in range(len(cu) - 1) if cu[t + 1] > cu[t] and cu[t] < end and cu[t + 1] > first)
        costs.append(end - first + segment * (touched - 1))
    return costs


def _least_makespan(cu: list[int], programs: int, block_n: int) -> int:
    """The least busiest-program cost of any split of the tiles into at most ``programs``
    contiguous ranges, by exhaustive dynamic programming (small steps only)."""
    total = cu[-1]
    best = [0] + [1 << 30] * total  # best[e]: the least makespan covering tiles [0, e)
    for _ in range(programs):
        best = [
            min([best[e]] + [max(best[g], _costs(cu, [(g, e)], block_n)[0]) for g in range(e)]) if e else 0
            for e in range(total + 1)
        ]
    return best[total]


def _check_plan(
    lens: list[int], programs: int, block_n: int, min_latents: int, direct: bool = False
) -> list[tuple[int, ...]]:
    """Asserts the plan's invariants; returns the busy programs."""
    work = list(plan_mla_work(lens, programs, block_n, min_latents, direct=direct))
    assert len(work) == mla_work_len(len(lens), programs)
    cu, prog, slots = _decode(work, len(lens), programs)
    assert cu == [0] + [sum(-(-max(n, 0) // block_n) for n in lens[: t + 1]) for t in range(len(lens))]
    busy = [p for p in prog if p[0] < p[1]]
    assert all(p == (0, 0, 0, -1, -1) for p in prog[len(busy) :]), "idle programs come last and hold nothing"
    # The busy programs' ranges tile [0, total) in order.
    assert [p[0] for p in busy] == [0, *(p[1] for p in busy[:-1])][: len(busy)]
    assert (busy[-1][1] if busy else 0) == cu[-1]
    least = max(1, -(-cu[-1] // programs), -(-min_latents // block_n))
    segment = max(1, SEGMENT_COST_LATENTS // block_n)
    costs = _costs(cu, [(p[0], p[1]) for p in busy], block_n)
    # Never above sharing the tiles and a segment for every token after the first equally.
    tokens_with_tiles = sum(1 for t in range(len(lens)) if cu[t + 1] > cu[t])
    assert max(costs, default=0) <= max(least, -(-(cu[-1] + segment * max(tokens_with_tiles - 1, 0)) // programs))
    touching: dict[int, list[int]] = {}  # token -> the programs with a segment of it
    for p, (first, end, t0, t1, _) in enumerate(busy):
        assert cu[t0] <= first < cu[t0 + 1] and cu[t1] < end <= cu[t1 + 1], "first and last token hold the range"
        for t in range(t0, t1 + 1):
            if cu[t + 1] > cu[t]:
                touching.setdefault(t, []).append(p)
    # Tokens with slots (direct: the split ones) own consecutive slots, one per segment,
    # numbered from 0 without gaps; the others have first slot -1.
    slotted = [t for t in sorted(touching) if len(touching[t]) > (1 if direct else 0)]
    expected_slot = 0
    for t, (first_slot, count) in enumerate(slots):
        assert count == len(touching.get(t, [])), t
        assert first_slot == (expected_slot if t in slotted else -1), t
        expected_slot += count if t in slotted else 0
    assert expected_slot <= mla_work_slots(programs, len(lens), direct)
    # The slot a program's segment takes: its first token's in the program field (by the
    # program's place among the token's), a later token's first (it starts in the program).
    for p, (_, _, t0, t1, slot) in enumerate(busy):
        assert slot == (slots[t0][0] + touching[t0].index(p) if t0 in slotted else -1), p
        for t in range(t0 + 1, t1 + 1):
            assert t not in touching or touching[t][0] == p, "a program's later tokens start in it"
    return busy


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_shares_every_tile_once(seed: int) -> None:
    rng = random.Random(seed)
    lens = [rng.choice([0, 1, rng.randint(1, 80), rng.randint(100, 3000)]) for _ in range(rng.randint(1, 40))]
    programs = rng.choice([1, 2, 3, 7, 64, 264])
    block_n, min_latents = rng.choice([16, 32, 64]), rng.choice([16, 256, 1024])
    busy = _check_plan(lens, programs, block_n, min_latents)
    assert len(busy) <= programs
    direct = _check_plan(lens, programs, block_n, min_latents, direct=True)
    assert [p[:4] for p in direct] == [p[:4] for p in busy], "direct changes only slots"


def test_the_plan_keeps_the_busiest_program_least() -> None:
    """64 rows of 4,096 latents over 264 programs: 32 tiles each, four per row, none crossing a
    row (the H200 measured crossings 7% slower there). Two short rows over two programs split
    where the busier costs least, segments counted; 128 LogNormal rows over 132 programs
    leave the busiest within two tiles of the mean."""
    busy = _check_plan([4096] * 64, 264, 32, 1024)
    assert len(busy) == 256 and all(t0 == t1 for _, _, t0, t1, _ in busy)
    # 7 + 1 tiles of 16 over 2 programs, a segment costing 4 tiles: 6 | 1 + (4) + 1.
    busy = _check_plan([100, 3], 2, 16, 16)
    assert [(g0, g1) for g0, g1, *_ in busy] == [(0, 6), (6, 8)]
    rng = random.Random(7)
    lens = [max(16, min(16384, int(rng.lognormvariate(8.0, 0.8)))) for _ in range(128)]
    busy = _check_plan(lens, 132, 64, 1024)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + -(-n // 64))
    mean = cu[-1] / 132
    assert max(_costs(cu, [(p[0], p[1]) for p in busy], 64)) <= mean + 2, "within two tiles of the mean"


@pytest.mark.parametrize("seed", range(30))
def test_no_sharing_has_a_less_busy_busiest_program(seed: int) -> None:
    """Against every split of small steps (exhaustive): the plan's busiest program costs the
    least any has (or ``min_latents``' share, where that is more)."""
    rng = random.Random(seed)
    lens = [rng.choice([0, rng.randint(1, 40), rng.randint(40, 300)]) for _ in range(rng.randint(1, 7))]
    programs, block_n, min_latents = rng.randint(1, 6), rng.choice([16, 32, 64]), rng.choice([16, 64])
    busy = _check_plan(lens, programs, block_n, min_latents)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + -(-max(n, 0) // block_n))
    least = _least_makespan(cu, programs, block_n)
    got = max(_costs(cu, [(p[0], p[1]) for p in busy], block_n), default=0)
    assert got == least or got <= -(-min_latents // block_n), (lens, programs, block_n, got, least)


@pytest.mark.parametrize(("programs", "block_n"), [(0, 64), (-1, 64), (4, 0), (True, 64), (2.0, 64)])
def test_a_plan_for_no_programs_or_tiles_is_refused_naming_the_argument(programs: object, block_n: object) -> None:
    with pytest.raises(InvalidArgumentError, match="programs" if programs != 4 else "block_n"):
        plan_mla_work([100, 30], programs, block_n, 64)  # type: ignore[arg-type]


def test_short_steps_use_few_programs() -> None:
    """A program takes at least ``min_latents``: one row of 1,024 latents is one program."""
    assert len(_check_plan([1024], 264, 32, 1024)) == 1
    assert len(_check_plan([0, 0, 0], 8, 32, 256)) == 0, "nothing to attend: no busy program"
    assert mla_work_programs(16, 16, 2, 132) == 264 and mla_work_programs(128, 64, 1, 132) == 66


def _run(lens: list[int], heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype, *, block_n: int,
         programs: int, unrolled: int, min_latents: int = 16, rows=None, seed: int = 0, direct: bool = False,
         **kw):  # type: ignore[no-untyped-def]  # fmt: skip
    query, cache, tables, latents = _case(lens, heads, rank, rope, block_size, torch.float64, seed=seed)
    token_rows = list(range(len(lens))) if rows is None else rows
    token_lens = [n if r >= 0 else 0 for n, r in zip(lens, token_rows, strict=True)]
    work = plan_mla_work(token_lens, programs, block_n, min_latents, direct=direct)
    out = mla_attention(
        query.to(DEVICE, dtype), kw.pop("cache", cache.to(DEVICE, dtype)), tables.to(DEVICE),
        torch.tensor(token_rows, dtype=torch.int32, device=DEVICE),
        torch.tensor(token_lens, dtype=torch.int32, device=DEVICE), kv_lora_rank=rank, scale=0.2,
        work=MLAWork(torch.tensor(work, dtype=torch.int32, device=DEVICE), programs, direct), block_n=block_n,
        unrolled=unrolled, **kw,
    )  # fmt: skip
    return out, query, latents


@pytest.mark.parametrize(
    ("lens", "heads", "rank", "rope", "block_size", "block_n", "programs", "unrolled"),
    [
        ([1, 37, 64, 5], 4, 32, 16, 32, 16, 3, 2),  # partial blocks and tiles, programs across rows
        ([100, 0, 33, 7], 16, 64, 16, 16, 32, 5, 0),  # blocks of 16 under tiles of 32, an empty row
        ([250, 1], 20, 32, 8, 32, 32, 4, 1),  # a second head tile, a narrow rotary part
        ([3, 2, 1], 4, 32, 16, 16, 16, 40, 2),  # more programs than tiles
        ([90, 91, 92, 3, 3, 3, 3, 40], 4, 32, 16, 64, 16, 2, 2),  # programs of many segments (the loop)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("direct", [False, True], ids=["slots", "direct"])
def test_the_balanced_kernels_match_float64(lens, heads, rank, rope, block_size, block_n, programs, unrolled,  # type: ignore[no-untyped-def]
                                            dtype, direct) -> None:  # fmt: skip
    out, query, latents = _run(lens, heads, rank, rope, block_size, dtype, block_n=block_n, programs=programs,
                               unrolled=unrolled, direct=direct)  # fmt: skip
    want = _reference(query.to(dtype).double(), [lat.to(dtype).double() for lat in latents], rank, 0.2)
    assert out.shape == (len(lens), heads, rank) and torch.isfinite(out).all(), "read an unowned (NaN) slot"
    err = (out.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < (2e-3 if dtype == torch.float32 else 2e-2), err


def test_many_short_tokens_store_whole_and_keep_the_partial_buffer_small() -> None:
    """200 short rows over 3 programs, planned direct: nearly every token lies whole in one
    program, which stores it (no slot); only the tokens a program boundary cuts take slots, at
    most 2 per program, however many tokens the step has. Steps whose slots would pass
    DIRECT_STORE_BYTES are planned so."""
    rng = random.Random(7)
    lens = [rng.randint(0, 40) for _ in range(200)]
    work = plan_mla_work(lens, 3, 16, 16, direct=True)
    _, _, slots = _decode(list(work), len(lens), 3)
    assert sum(1 for first, count in slots if count == 1 and first == -1) >= 195
    assert sum(c for first, c in slots if first >= 0) <= mla_work_slots(3, 200, True) == 6
    out, query, latents = _run(lens, 4, 32, 16, 16, torch.float32, block_n=16, programs=3, unrolled=2, seed=7,
                               direct=True)  # fmt: skip
    want = _reference(query.double(), [lat.double() for lat in latents], 32, 0.2)
    assert (out.double().cpu() - want).abs().max().item() < 2e-3
    # 128 heads x 512 channels (256 KiB a slot): 66 programs and 128 tokens stay under the
    # budget (50 MB), 512 tokens would take 151 MB.
    per_slot = 128 * 512 * 4
    assert not mla_direct_store(128, 66, 128, 512) and (66 + 128) * per_slot <= DIRECT_STORE_BYTES
    assert mla_direct_store(512, 66, 128, 512) and not mla_direct_store(512, 264, 16, 512)


@pytest.mark.parametrize("f16_dots", [True, False], ids=["fp16-dots", "bf16-dots"])
def test_an_fp8_latent_and_an_output_in_place(f16_dots: bool) -> None:
    """An fp8 cache with its scale (dots in fp16 as at 16 heads, or in the query's bf16 as at
    64), the result stored into the first R channels of a bf16 output (planned direct with
    the fp16 dots); padding tokens (row -1) get zeros."""
    lens, rank, rope, heads = [70, 5, 33, 0], 32, 16, 4
    _, cache, _, latents = _case(lens, heads, rank, rope, 16, torch.float64, seed=5)
    kv_scale = 0.05
    stored = (cache / kv_scale).to(torch.float8_e4m3fn).to(DEVICE)
    target = torch.full((len(lens), heads, rank + rope), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out, query, _ = _run(lens, heads, rank, rope, 16, torch.bfloat16, block_n=32, programs=3, unrolled=2, seed=5,
                         rows=[0, 1, -1, 3], cache=stored, kv_scale=torch.tensor([kv_scale], device=DEVICE),
                         out=target, f16_fp8_dots=f16_dots, direct=f16_dots)  # fmt: skip
    assert out.data_ptr() == target.data_ptr()
    dequantized = [(lat / kv_scale).to(torch.float8_e4m3fn).double() * kv_scale for lat in latents]
    want = _reference(query.to(torch.bfloat16).double(), dequantized, rank, 0.2)
    want[2] = 0
    err = (target[..., :rank].double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < 3e-2, err
    assert (target[..., rank:] == 7.0).all() and not target[2, :, :rank].any() and not target[3, :, :rank].any()
    _run(lens, heads, rank, rope, 16, torch.bfloat16, block_n=32, programs=3, unrolled=2, seed=5, rows=[0, 1, -1, 3],
         cache=stored, kv_scale=torch.tensor([kv_scale], device=DEVICE), out=target, zero_rest=True,
         direct=f16_dots)  # fmt: skip
    assert not target[..., rank:].any(), "zero_rest: the rotary channels are zeroed"
    err = (target[..., :rank].double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < 3e-2, err


@pytest.mark.parametrize("direct", [False, True], ids=["slots", "direct"])
def test_tokens_that_see_nothing_keep_their_rows_when_asked(direct: bool) -> None:
    """``skip_unseen`` (a step's tokens attending decompressed, whose output comes from
    elsewhere): a token without latents (row -1 or length 0) keeps every channel of its rows
    of ``out``; the others get their attention and zeroed rotary channels as without it.
    ``merge_tokens`` bounds the merge's launch: tokens outside keep their rows. The split
    schedule, which stores every token, refuses both by name, and a range outside the tokens
    is refused."""
    lens, rank, rope, heads = [70, 5, 33, 0, 40], 32, 16, 4
    rows = [0, 1, -1, 3, 4]
    target = torch.full((len(lens), heads, rank + rope), 7.0, dtype=torch.bfloat16, device=DEVICE)
    _, query, latents = _run(lens, heads, rank, rope, 16, torch.bfloat16, block_n=32, programs=3, unrolled=1, seed=8,
                             rows=rows, out=target, zero_rest=True, direct=direct, skip_unseen=True)  # fmt: skip
    want = _reference(query.to(torch.bfloat16).double(), [lat.to(torch.bfloat16).double() for lat in latents], rank,
                      0.2)  # fmt: skip
    seen = [0, 1, 4]
    err = (target[seen, :, :rank].double().cpu() - want[seen]).abs().max().item() / want.abs().max().item()
    assert err < 2e-2, err
    assert not target[seen, :, rank:].any(), "zero_rest still zeroes the rotary channels of tokens it stores"
    assert (target[[2, 3]] == 7.0).all(), "tokens without latents are not stored"
    _run(lens, heads, rank, rope, 16, torch.bfloat16, block_n=32, programs=3, unrolled=1, seed=8, rows=rows,
         out=target, zero_rest=True, direct=direct)  # fmt: skip
    assert not target[[2, 3]].any(), "without skip_unseen they get zeros"
    # merge_tokens: the merge runs on tokens 0 and 1 only; 2, 3 and 4 see nothing and keep
    # their rows whole, skip_unseen or not.
    target.fill_(7.0)
    _run(lens, heads, rank, rope, 16, torch.bfloat16, block_n=32, programs=3, unrolled=1, seed=8,
         rows=[0, 1, -1, 3, -1], out=target, zero_rest=True, direct=direct, merge_tokens=(0, 2))  # fmt: skip
    err = (target[:2, :, :rank].double().cpu() - want[:2]).abs().max().item() / want.abs().max().item()
    assert err < 2e-2, err
    assert not target[:2, :, rank:].any() and (target[2:] == 7.0).all()
    query, cache, tables, _ = _case(lens, heads, rank, rope, 16, torch.float32)
    ints = torch.zeros(len(lens), dtype=torch.int32, device=DEVICE)
    args = (query.float().to(DEVICE), cache.float().to(DEVICE), tables.to(DEVICE), ints, ints)
    with pytest.raises(InvalidArgumentError, match="skip_unseen"):
        mla_attention(*args, kv_lora_rank=rank, scale=0.2, skip_unseen=True)
    with pytest.raises(InvalidArgumentError, match="merge_tokens"):
        mla_attention(*args, kv_lora_rank=rank, scale=0.2, merge_tokens=(0, 2))
    work = MLAWork(torch.tensor(plan_mla_work([0] * len(lens), 3, 32, 16), dtype=torch.int32, device=DEVICE), 3)
    for bad in ((3, 2), (0, len(lens) + 1), (-1, 2), (0.0, 2)):
        with pytest.raises(InvalidArgumentError, match="merge_tokens"):
            mla_attention(*args, kv_lora_rank=rank, scale=0.2, work=work, block_n=32, merge_tokens=bad)  # type: ignore[arg-type]


def test_causal_rows_on_the_balanced_schedule() -> None:
    """Rows of several new tokens (each sees its prefix), as the backend plans them."""
    lens, new, rank, rope, heads = [70, 33, 9], [6, 1, 9], 32, 16, 4
    _, cache, tables, latents = _case(lens, heads, rank, rope, 32, torch.float64, seed=3)
    rows, token_lens = causal_queries(lens, new)
    queries = torch.randn(len(rows), heads, rank + rope, generator=torch.Generator().manual_seed(4),
                          dtype=torch.float64)  # fmt: skip
    work = plan_mla_work(token_lens, 4, 16, 16)
    out = mla_attention(
        queries.float().to(DEVICE), cache.float().to(DEVICE), tables.to(DEVICE),
        torch.tensor(rows, dtype=torch.int32, device=DEVICE),
        torch.tensor(token_lens, dtype=torch.int32, device=DEVICE),
        kv_lora_rank=rank, scale=0.2, work=MLAWork(torch.tensor(work, dtype=torch.int32, device=DEVICE), 4),
        block_n=16, unrolled=1,
    )  # fmt: skip
    want = torch.stack([
        _reference(queries[t : t + 1], [latents[r][:n]], rank, 0.2)[0]
        for t, (r, n) in enumerate(zip(rows, token_lens, strict=True))
    ])  # fmt: skip
    assert (out.double().cpu() - want).abs().max().item() < 2e-3


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the interpreter's numpy on garbage sums)
@pytest.mark.parametrize("seed", range(3))
def test_any_work_array_stays_inside_the_buffers(seed: int) -> None:
    """A work array of random values (a caller's bug) reads and writes nothing outside the
    cache, the partial buffers and the output (direct stores too, seeds 1 and 2): the launch
    completes, the cache is untouched and so is the memory around the output (on the
    GPU an out-of-bounds access would fault; the interpreter raises on one)."""
    lens = [40, 12, 7]
    query, cache, tables, _ = _case(lens, 4, 32, 16, 16, torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    programs = 3
    junk = torch.randint(-(2**31), 2**31 - 1, (mla_work_len(3, programs),), generator=gen, dtype=torch.int64)
    junk[torch.rand(junk.shape, generator=gen) < 0.5] %= 50  # small values too, which reach the loops
    c = cache.float().to(DEVICE)
    before = c.clone()
    # The output: rows 1..3 of a larger tensor, whose rows 0 and 4 must stay as they are.
    outer = torch.full((5, 4, 48), 3.0, device=DEVICE)
    mla_attention(
        query.float().to(DEVICE), c, tables.to(DEVICE), torch.arange(3, dtype=torch.int32, device=DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE), kv_lora_rank=32, scale=0.1, block_n=16, unrolled=1,
        work=MLAWork(junk.to(torch.int32).to(DEVICE), programs, direct=seed > 0), out=outer[1:4],
    )  # fmt: skip
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(c.isnan(), before.isnan()) and torch.equal(c.nan_to_num(), before.nan_to_num())
    assert (outer[0] == 3.0).all() and (outer[4] == 3.0).all() and (outer[1:4, :, 32:] == 3.0).all()


def test_a_plan_with_counters_ends_in_zeros_for_each_token_and_head() -> None:
    """``counters=True`` (the Hopper kernel's merge in the kernel): the same plan followed by
    16 zeros a token, and :func:`mla_work_len` counts them; without, a plan carries none."""
    lens = [70, 0, 33, 200]
    bare = list(plan_mla_work(lens, 3, 32, 16))
    counted = list(plan_mla_work(lens, 3, 32, 16, counters=True))
    assert counted == bare + [0] * 16 * len(lens)
    assert len(bare) == mla_work_len(len(lens), 3) and len(counted) == mla_work_len(len(lens), 3, counters=True)


def test_bad_work_is_refused_naming_it() -> None:
    query, cache, tables, _ = _case([8], 4, 32, 16, 32, torch.float32)
    q, c = query.float(), cache.float()
    rows, lens = torch.zeros(1, dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    good = torch.tensor(plan_mla_work([8], 2, 32, 16), dtype=torch.int32)
    for work, match in (
        (MLAWork(good[:-1], 2), f"work.data: expected an int32 \\[{mla_work_len(1, 2)}\\]"),
        (MLAWork(good.long(), 2), "work.data"),
        (MLAWork(good, 0), "work.programs"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            mla_attention(q, c, tables, rows, lens, kv_lora_rank=32, scale=0.1, work=work)
    with pytest.raises(InvalidArgumentError, match="a balanced schedule takes no splits"):
        mla_attention(q, c, tables, rows, lens, kv_lora_rank=32, scale=0.1, work=MLAWork(good, 2), num_splits=2)
    with pytest.raises(InvalidArgumentError, match="unrolled"):
        mla_attention(q, c, tables, rows, lens, kv_lora_rank=32, scale=0.1, work=MLAWork(good, 2), unrolled=9)
