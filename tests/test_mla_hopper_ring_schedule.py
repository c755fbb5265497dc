"""The load schedule of the deeper-ring Hopper MLA kernel
(attention/triton_kernels/mla_decode_hopper_ring.py), checked without a GPU.

The kernel's loads and waits are transcribed here step for step (the prologue, the load cursor
that walks a program's segments ahead of the compute, the refills after each P V MMA, the
query loaded after a segment's last S) and run against a model of its shared memory: every
half buffer, rotary buffer and the query buffer records what was loaded into it and whether it
has been read since. The model asserts what the GPU would not report but corrupt silently:

- a wait finds the load it expects on the buffer (the barrier's parity names one use: a wait
  two uses behind, or ahead, would pass on the wrong data), holding the tile and channel half
  the compute expects;
- no buffer is refilled before the MMAs that read its previous content are done (a latent
  half: both its S and its P V; a rotary part: its S; the query: the segment's last S);
- nothing is in flight when the program ends (an unwaited TMA into freed shared memory);
- the tiles are computed in the order the compute loop walks them, each segment's once.

It runs on real plans (:func:`plan_mla_work`) and on hostile work arrays, rows and lengths;
with a rotary ring of 2 or a ring of 4 halves it fails. The GPU tests
(tests/test_mla_decode_hopper.py) check the kernel's numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from attention.triton_kernels.mla_balanced import mla_work_len, plan_mla_work
from attention.triton_kernels.mla_decode_hopper_ring import HALVES, ROPES

BLOCK_N = 64


class ScheduleError(AssertionError):
    """A load or wait the kernel would get wrong."""


@dataclass
class Step:
    """What one program's kernel sees: its work array and the step's metadata."""

    work: list[int]
    rows: list[int]
    lens: list[int]
    num_tokens: int
    num_rows: int
    table_width: int
    block_size: int


@dataclass
class Buffer:
    """A shared-memory buffer: what was last loaded into it, whether it arrived and was waited
    on, the loads it has had (its barrier's completed phases) and whether its reader is done."""

    content: object = None
    loads: int = 0
    waited: int = 0
    read_done: bool = True


@dataclass
class Machine:
    """The program's shared memory, as the model tracks it."""

    halves: list[Buffer]
    ropes: list[Buffer]
    query: Buffer = field(default_factory=Buffer)
    computed: list[tuple[int, int]] = field(default_factory=list)

    def load(self, buf: Buffer, content: object, what: str) -> None:
        if not buf.read_done:
            raise ScheduleError(f"{what} refilled before its reader was done")
        if buf.loads > buf.waited:
            raise ScheduleError(f"{what} refilled while its last load was never waited on")
        buf.content, buf.loads, buf.read_done = content, buf.loads + 1, False

    def wait(self, buf: Buffer, phase: int, use: int, content: object, what: str) -> None:
        """``mbarrier.wait(bar, phase)`` for the buffer's ``use``-th load (from 0)."""
        if buf.loads <= buf.waited:
            raise ScheduleError(f"{what}: waited on with no load in flight (would hang)")
        if phase != buf.waited & 1 or use != buf.waited:
            raise ScheduleError(f"{what}: parity {phase} waits on load {buf.waited}, the kernel means load {use}")
        if buf.content != content:
            raise ScheduleError(f"{what} holds {buf.content}, the compute expects {content}")
        buf.waited += 1


def _clamp(x: int, lo: int, hi: int) -> int:
    return min(max(x, lo), hi)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _program_work(s: Step, pid: int, programs: int) -> tuple[int, int, int, int]:
    base = s.num_tokens + 1 + 5 * pid
    g0, g1 = s.work[base], s.work[base + 1]
    t0 = _clamp(s.work[base + 2], 0, s.num_tokens - 1)
    t_stop = min(s.work[base + 3], s.num_tokens - 1) + 1 if g0 < g1 else t0
    return g0, g1, t0, t_stop


def _segment_extent(s: Step, t: int, g0: int, g1: int) -> tuple[int, int, int, int]:
    """(seg_start, seg_end, start, end) as the kernel's ``_segment_extent``."""
    t_first = s.work[t]
    seg_start, seg_end = max(g0, t_first), min(g1, s.work[t + 1])
    row_ok = 0 <= s.rows[t] < s.num_rows
    seq_len = _clamp(s.lens[t], 0, s.table_width * s.block_size) if row_ok else 0
    most = _cdiv(s.table_width * s.block_size, BLOCK_N)
    start = _clamp(seg_start - t_first, 0, most) * BLOCK_N
    end = min(_clamp(seg_end - t_first, 0, most) * BLOCK_N, seq_len)
    return seg_start, seg_end, start, end


def _next_busy_token(s: Step, t: int, t_stop: int, g0: int, g1: int) -> tuple[int, int, int]:
    u, start, end = t, 0, 0
    while u < t_stop:
        _, _, start, end = _segment_extent(s, u, g0, g1)
        if end > start:
            break
        u += 1
    return u, start, end


def run_program(s: Step, pid: int, programs: int, halves: int = HALVES, ropes: int = ROPES) -> list[tuple[int, int]]:
    """The kernel's program ``pid`` on the model; returns the tiles computed as (token,
    first latent)."""
    m = Machine([Buffer() for _ in range(halves)], [Buffer() for _ in range(ropes)])
    g0, g1, t0, t_stop = _program_work(s, pid, programs)
    cursor = list(_next_busy_token(s, t0, t_stop, g0, g1))  # token, next latent, segment end

    def load_half(h: int, second: bool) -> None:
        """Half ``h`` of the cursor's tile: the first (with the rotary part) or the second, which
        advances the cursor. Each call site of the kernel loads one kind of half."""
        if h % 2 != second:
            raise ScheduleError(f"half {h} loaded as the {'second' if second else 'first'} channel half")
        lt, ln0, lend = cursor
        m.load(m.halves[h % halves], (lt, ln0, h % 2), f"half buffer {h % halves}")
        if not second:
            rope = m.ropes[(h // 2) % ropes]
            if not rope.read_done:
                raise ScheduleError(f"rotary buffer {(h // 2) % ropes} refilled before its S")
            rope.content, rope.read_done = (lt, ln0), False  # it arrives on the half's barrier
        else:
            ln0 += BLOCK_N
            cursor[:] = [lt, ln0, lend] if ln0 < lend else list(_next_busy_token(s, lt + 1, t_stop, g0, g1))

    if cursor[0] < t_stop:
        m.load(m.query, cursor[0], "query")
    for h in range(halves):
        if cursor[0] < t_stop:
            load_half(h, h % 2 == 1)
    k = segs = 0
    for t in range(t0, t_stop):
        seg_start, seg_end, start, end = _segment_extent(s, t, g0, g1)
        if seg_end <= seg_start:
            continue
        n_tiles = _cdiv(max(end - start, 0), BLOCK_N)
        q_next = _next_busy_token(s, t + 1, t_stop, g0, g1)[0]
        if n_tiles > 0:
            m.wait(m.query, segs & 1, segs, t, "query")
        for j in range(n_tiles):
            n0 = start + j * BLOCK_N
            ha, hb = 2 * k, 2 * k + 1
            a, b, e = m.halves[ha % halves], m.halves[hb % halves], m.ropes[k % ropes]
            m.wait(a, (ha // halves) & 1, ha // halves, (t, n0, 0), f"half buffer {ha % halves}")
            if e.content != (t, n0) or e.read_done:
                raise ScheduleError(f"rotary buffer {k % ropes} holds {e.content}, S expects {(t, n0)}")
            m.wait(b, (hb // halves) & 1, hb // halves, (t, n0, 1), f"half buffer {hb % halves}")
            e.read_done = True  # S is done (warpgroup_mma_wait(0))
            m.computed.append((t, n0))
            if j == n_tiles - 1:
                m.query.read_done = True  # the segment's last S has read the query
                if q_next < t_stop:
                    m.load(m.query, q_next, "query")
            a.read_done = True  # the first P V MMA is done (wait(1)): a second half follows
            if cursor[0] < t_stop:
                load_half(ha + halves, True)
            b.read_done = True  # the second one (wait(0)): a first half and rotary part follow
            if cursor[0] < t_stop:
                load_half(hb + halves, False)
            k += 1
        segs += n_tiles > 0
    for name, buf in [("query", m.query), *((f"half buffer {i}", x) for i, x in enumerate(m.halves))]:
        if buf.loads != buf.waited:
            raise ScheduleError(f"{name}: {buf.loads - buf.waited} load(s) in flight when the program ends")
    return m.computed


def _expected_tiles(s: Step, pid: int, programs: int) -> list[tuple[int, int]]:
    g0, g1, t0, t_stop = _program_work(s, pid, programs)
    tiles = []
    for t in range(t0, t_stop):
        _, _, start, end = _segment_extent(s, t, g0, g1)
        tiles += [(t, n) for n in range(start, end, BLOCK_N)]
    return tiles


def _planned(lens: list[int], programs: int, block_size: int, direct: bool = False) -> Step:
    width = max([_cdiv(n, block_size) for n in lens] + [1])
    work = list(plan_mla_work(lens, programs, BLOCK_N, 64, direct=direct))
    return Step(work, list(range(len(lens))), lens, len(lens), len(lens), width, block_size)


def _check(s: Step, programs: int, **ring: int) -> None:
    for pid in range(programs):
        assert run_program(s, pid, programs, **ring) == _expected_tiles(s, pid, programs), pid


@pytest.mark.parametrize(
    ("lens", "programs", "block_size"),
    [
        ([1, 37, 64, 200, 129, 0, 300], 5, 64),
        ([40, 41, 42, 43, 1000], 2, 64),  # programs of several segments, some of one tile
        ([64] * 9, 1, 128),  # one program, a tile per token
        ([4096] * 8, 3, 64),
        ([0, 0, 65, 0, 1, 0], 2, 64),  # empty rows between busy ones
        ([5], 4, 256),
    ],
)
def test_planned_steps_load_and_wait_in_order(lens: list[int], programs: int, block_size: int) -> None:
    _check(_planned(lens, programs, block_size), programs)


def test_random_plans() -> None:
    rng = random.Random(0)
    for _ in range(150):
        tokens = rng.randint(1, 12)
        lens = [rng.choice([0, 1, 63, 64, 65]) if rng.random() < 0.3 else int(rng.lognormvariate(5, 1.2)) for _ in
                range(tokens)]  # fmt: skip
        programs = rng.randint(1, 9)
        _check(_planned(lens, programs, rng.choice([64, 128, 256]), direct=rng.random() < 0.5), programs)


def test_hostile_work_arrays_rows_and_lengths() -> None:
    """Random work arrays (ranges, tokens, offsets), rows outside the table and lengths past it:
    the clamps keep the load cursor and the compute walking the same tiles."""
    rng = random.Random(1)
    for _ in range(250):
        tokens, programs = rng.randint(1, 6), rng.randint(1, 4)
        work = [rng.randint(-5, 60) for _ in range(mla_work_len(tokens, programs))]
        rows = [rng.randint(-2, tokens + 1) for _ in range(tokens)]
        lens = [rng.randint(-70, 900) for _ in range(tokens)]
        s = Step(work, rows, lens, tokens, tokens, rng.randint(1, 4), rng.choice([64, 128]))
        _check(s, programs)


@pytest.mark.parametrize(
    ("halves", "ropes", "error"),
    [(5, 2, "rotary buffer 0 refilled before its S"), (7, 3, "rotary buffer"), (4, 3, "channel half")],
)
def test_other_rings_are_caught(halves: int, ropes: int, error: str) -> None:
    """The model is not vacuous: a rotary ring of 2 (or of 3 under 7 halves) overwrites a
    rotary part before its S; an even ring of halves swaps the halves each refill loads."""
    with pytest.raises(ScheduleError, match=error):
        _check(_planned([4096, 300], 1, 64), 1, halves=halves, ropes=ropes)
