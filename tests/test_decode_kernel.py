"""The token-balanced decode kernel (attention.triton_kernels.decode) against a float64
reference, launched directly with its schedule, device metadata and workspace.

Without a GPU this runs in Triton's CPU interpreter (tests/conftest.py), so shapes stay small;
the CUDA-graph replay runs on a GPU only. Caches come from tests/paged_case.py (shuffled block
ids, NaN in every slot no token was written to) and sit between two NaN blocks, so a read of
an unused slot, of a padded table entry or just outside the cache turns the output NaN. Both
combine modes run every case. What the triton backend decides around this kernel (its plan,
its chunk lengths) is tests/test_triton_backend.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attention import ReferenceBackend
from attention.triton_kernels import (
    DecodeConfig,
    DecodeSchedule,
    DecodeWorkspace,
    allocate_decode_workspace,
    decode_metadata,
    max_decode_items,
    max_decode_partials,
    paged_decode,
    schedule_decode,
)
from attention.triton_kernels.decode_schedule import ITEM_FIELDS, ROW_FIELDS
from attention.triton_kernels.paging import kernels_interpreted
from attention.value_layout import is_token_major, token_major_view
from tests.paged_case import (
    TOLERANCE,
    PagedCase,
    ancestor_masks,
    make_case,
    make_spec,
    reference_output,
    rel_err,
    tree_reference,
)

pytestmark = pytest.mark.kernel

#: Where the kernels run: the CPU interpreter without a GPU, else the GPU.
DEVICE = "cpu" if kernels_interpreted() else "cuda"

SMS = 132  # the H200's, as the backend assumes under the interpreter
COMBINE = pytest.mark.parametrize("fused", [False, True], ids=["combine-kernel", "fused-combine"])


def _case(
    lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
) -> PagedCase:
    """Rows of ``lens`` K/V tokens (the last one new, written by the reference), caches
    wrapped in NaN blocks."""
    spec = make_spec(heads, kv_heads, head_dim, dtype)
    case = make_case([(n - 1, 1) for n in lens], spec, block_size=block_size, device=device, spare_blocks=2)
    writer = ReferenceBackend(spec)
    writer.write_kv(case.new_key, case.new_value, case.layer, writer.plan(case.meta))
    return case


def _reference(
    case: PagedCase,
    ranges: list[tuple[int, int]],
    table_rows: list[int],
    q_tokens: list[int],
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """float64 [rows, heads, head_dim]: row d's query token over its kv range (any window)."""
    k_all = case.layer.key.double().flatten(0, 1)  # [slots, kv_heads, d]
    v_all = case.layer.value.double().flatten(0, 1)
    if kv_scales is not None:
        k_all, v_all = k_all * kv_scales[0].double()[:, None], v_all * kv_scales[1].double()[:, None]
    bs = case.layer.block_size
    heads, kvh = case.query.shape[1], case.layer.key.shape[2]
    outs = []
    for (start, end), row, token in zip(ranges, table_rows, q_tokens, strict=True):
        pos = torch.arange(start, end, device=case.query.device)
        slots = case.meta.block_tables[row, pos // bs].long() * bs + pos % bs
        k = k_all[slots].repeat_interleave(heads // kvh, dim=1)  # [n, heads, d]
        v = v_all[slots].repeat_interleave(heads // kvh, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", case.query[token].double(), k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


@dataclasses.dataclass
class Launch:
    schedule: DecodeSchedule
    rows: torch.Tensor
    items: torch.Tensor
    workspace: DecodeWorkspace


def _prepare(case: PagedCase, block_n: int, **schedule_args: object) -> Launch:
    heads, head_dim = case.query.shape[1:]
    kvh = case.layer.key.shape[2]
    args: dict[str, object] = {"kv_ranges": [(0, n) for n in case.meta.seq_lens_host], "num_sms": SMS}
    args.update(schedule_args)
    schedule = schedule_decode(num_kv_heads=kvh, block_n=block_n, **args)  # type: ignore[arg-type]
    rows, items = decode_metadata(schedule, DEVICE)
    ws = allocate_decode_workspace(
        max_rows=schedule.grid_rows,
        max_partials=schedule.num_partials,
        num_heads=heads,
        num_kv_heads=kvh,
        head_dim=head_dim,
        device=DEVICE,
    )
    return Launch(schedule, rows, items, ws)


def _run(
    case: PagedCase,
    launch: Launch,
    config: DecodeConfig,
    out: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The kernel over the case's query and layer (``scales``: an fp8 cache's (k_scale,
    v_scale)), softmax scale 1 / sqrt(head_dim)."""
    out = torch.zeros_like(case.query) if out is None else out
    scale = 1.0 / math.sqrt(case.query.shape[2])
    return paged_decode(
        case.query,
        case.layer.key,
        case.layer.value,
        case.meta.block_tables,
        launch.rows,
        launch.items,
        launch.schedule,
        launch.workspace,
        softmax_scale=scale,
        out=out,
        config=config,
        k_scale=None if scales is None else scales[0],
        v_scale=None if scales is None else scales[1],
    )


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "NaN in the output: a read outside the written slots"
    torch.testing.assert_close(out.double(), ref.double(), **TOLERANCE[dtype])


CASES = [
    # dtype, block_size, heads, kv_heads, head_dim, row lengths, block_n, forced chunk_len
    pytest.param(torch.float32, 32, 2, 2, 64, [1, 31, 32, 33, 97], 16, 32, id="fp32-gqa1-d64-odd"),
    pytest.param(torch.float16, 64, 8, 2, 72, [1, 64, 65, 200], 32, 64, id="fp16-gqa4-d72"),
    pytest.param(torch.bfloat16, 32, 8, 1, 96, [5, 32, 150], 64, 64, id="bf16-gqa8-d96-tile-spans-blocks"),
    pytest.param(torch.float16, 32, 7, 1, 64, [40, 97, 200], 32, None, id="fp16-gqa7-policy"),
]


@pytest.mark.parametrize(("dtype", "block_size", "heads", "kv_heads", "head_dim", "lens", "block_n", "chunk"), CASES)
@COMBINE
def test_matches_float64_reference(
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    lens: list[int],
    block_n: int,
    chunk: int | None,
    fused: bool,
) -> None:
    case = _case(lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    launch = _prepare(case, block_n, chunk_len=chunk)
    assert launch.schedule.num_partials > 0, "the case should split some row"
    out = _run(case, launch, DecodeConfig(block_n=block_n, fused_combine=fused))
    _check(out, reference_output(case), dtype)
    assert not launch.workspace.counters.any(), "fused counters must be back at 0"


@COMBINE
def test_padded_grid_writes_only_the_named_tokens(fused: bool) -> None:
    """A fixed grid larger than the step (CUDA-graph bucket of 6 rows on a 16-SM GPU), rows
    reading table rows and query tokens out of order: tokens no row names keep their bits."""
    case = _case([70, 9, 33, 40, 5, 64], heads=4, kv_heads=2, head_dim=32, block_size=32, dtype=torch.float16)
    table_rows, q_tokens = [2, 0, 5], [4, 1, 5]
    ranges = [(0, case.meta.seq_lens_host[r]) for r in table_rows]
    launch = _prepare(
        case,
        16,
        kv_ranges=ranges,
        table_rows=table_rows,
        q_tokens=q_tokens,
        chunk_len=16,
        num_sms=16,
        max_items=max_decode_items(6, 2, 16),
        max_rows=6,
    )
    assert launch.schedule.grid_items > launch.schedule.num_items
    out = torch.full_like(case.query, 7.0)
    _run(case, launch, DecodeConfig(block_n=16, fused_combine=fused), out)
    untouched = [0, 2, 3]
    assert torch.equal(out[untouched], torch.full_like(out[untouched], 7.0))
    scale = 1.0 / math.sqrt(32)
    _check(out[q_tokens], _reference(case, ranges, table_rows, q_tokens, scale), torch.float16)


@COMBINE
def test_sliding_window_reads_only_the_window(fused: bool) -> None:
    """kv_start > 0, mid-block and off the tile grid: tokens before the window are NaN and
    their table entries PAD, so any read of them shows."""
    case = _case([150, 97, 64, 40], heads=4, kv_heads=2, head_dim=32, block_size=32, dtype=torch.float32)
    starts = [37, 64, 63, 0]
    bs, kvh, d = case.layer.key.shape[1:]
    for row, start in enumerate(starts):
        pos = torch.arange(start, device=case.layer.key.device)
        slots = case.meta.block_tables[row, pos // bs].long() * bs + pos % bs
        case.layer.key.view(-1, kvh, d)[slots] = float("nan")
        case.layer.value.view(-1, kvh, d)[slots] = float("nan")
        case.meta.block_tables[row, : start // bs] = -1  # blocks wholly before the window: freed
    ranges = [(s, n) for s, n in zip(starts, case.meta.seq_lens_host, strict=True)]
    launch = _prepare(case, 16, kv_ranges=ranges, chunk_len=32)
    out = _run(case, launch, DecodeConfig(block_n=16, fused_combine=fused))
    ref = _reference(case, ranges, [0, 1, 2, 3], [0, 1, 2, 3], 1.0 / math.sqrt(32))
    _check(out, ref, torch.float32)


def test_skipping_the_combine_is_refused_where_rows_split() -> None:
    """``paged_decode(combine=False)`` (a graph variant for steps whose rows stay whole) on a
    schedule that splits a row is refused before any kernel runs; on one that does not, the
    output is the combined launch's."""
    case = _case([90, 17, 50], heads=2, kv_heads=1, head_dim=32, block_size=32, dtype=torch.float32)
    split = _prepare(case, 16, chunk_len=16)
    assert split.schedule.num_partials > 0
    scale = 1.0 / math.sqrt(32)
    args = (case.query, case.layer.key, case.layer.value, case.meta.block_tables)
    out = torch.full_like(case.query, 7.0)
    with pytest.raises(ValueError, match="combine: False, but the schedule splits rows"):
        paged_decode(*args, split.rows, split.items, split.schedule, split.workspace, softmax_scale=scale,
                     out=out, config=DecodeConfig(block_n=16), combine=False)  # fmt: skip
    assert torch.equal(out, torch.full_like(case.query, 7.0))
    whole = _prepare(case, 16, chunk_len=96)
    assert whole.schedule.num_partials == 0
    direct = paged_decode(*args, whole.rows, whole.items, whole.schedule, whole.workspace, softmax_scale=scale,
                          out=torch.zeros_like(case.query), config=DecodeConfig(block_n=16), combine=False)  # fmt: skip
    assert torch.equal(direct, _run(case, whole, DecodeConfig(block_n=16)))
    _check(direct, reference_output(case), torch.float32)


def test_fused_combine_counters_reset_across_launches() -> None:
    """Replays on one workspace (as a CUDA graph does) give the same output, and a later
    step with another chunking reuses the counters correctly."""
    case = _case([90, 17, 50], heads=2, kv_heads=1, head_dim=32, block_size=32, dtype=torch.float32)
    config = DecodeConfig(block_n=16, fused_combine=True)
    launch = _prepare(case, 16, chunk_len=16)
    first = _run(case, launch, config)
    for _ in range(2):
        assert not launch.workspace.counters.any()
        assert torch.equal(_run(case, launch, config), first)
    other = _prepare(case, 16, chunk_len=32)
    other = dataclasses.replace(other, workspace=launch.workspace)
    _check(_run(case, other, config), reference_output(case), torch.float32)
    _check(first, reference_output(case), torch.float32)


def _multi_case(rows: list[tuple[int, int]], dtype: torch.dtype, **spec_kw: object) -> PagedCase:
    """Rows of (context, new tokens), the new tokens' K/V written by the reference backend;
    8 query heads over 2 KV heads, head_dim 32, block 32, caches wrapped in NaN blocks."""
    spec = make_spec(8, 2, 32, dtype, **spec_kw)
    case = make_case(rows, spec, block_size=32, device=DEVICE, spare_blocks=2, seed=len(rows))
    writer = ReferenceBackend(spec)
    writer.write_kv(case.new_key, case.new_value, case.layer, writer.plan(case.meta))
    return case


def _multi_launch(case: PagedCase, window: int | None = None, **schedule_args: object) -> Launch:
    s_lens, q_lens = case.meta.seq_lens_host, case.meta.query_lens_host
    starts = case.meta.query_start_loc.tolist()[: case.meta.batch]
    w = window or 10**9
    ranges = [(max(0, s - q + 1 - w), s) for s, q in zip(s_lens, q_lens, strict=True)]
    return _prepare(case, 16, kv_ranges=ranges, q_lens=list(q_lens), q_tokens=starts, **schedule_args)


MULTI_ROWS = [(30, 4), (96, 1), (64, 8), (5, 3), (0, 2), (47, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [16, None], ids=["split-rows", "policy"])
@COMBINE
def test_rows_of_several_new_tokens_match_float64_reference(dtype: torch.dtype, chunk: int | None, fused: bool) -> None:
    """Rows verifying drafts (2-8 new tokens, causal among themselves) beside one-token rows,
    the chunks cut through the new tokens: each new token sees exactly its prefix."""
    case = _multi_case(MULTI_ROWS, dtype)
    launch = _multi_launch(case, chunk_len=chunk)
    assert launch.schedule.query_len == 8
    if chunk:
        assert launch.schedule.num_partials > 0, "the case should split some row"
    out = _run(case, launch, DecodeConfig(block_n=16, fused_combine=fused))
    _check(out, reference_output(case), dtype)
    assert not launch.workspace.counters.any(), "fused counters must be back at 0"


@COMBINE
def test_fixed_grid_for_eight_tokens_serves_shorter_rows(fused: bool) -> None:
    """A bucket compiled for 8 tokens per row (a CUDA graph's fixed choice) running rows of
    1-3 tokens, on a padded grid: the same outputs, and no other token written."""
    case = _multi_case([(40, 1), (17, 3), (80, 2)], torch.float32)
    launch = _multi_launch(
        case, chunk_len=32, num_sms=16, max_items=max_decode_items(5, 2, 16), max_rows=5, max_query_len=8
    )
    assert launch.schedule.query_len == 8 and launch.schedule.grid_items > launch.schedule.num_items
    out = torch.full((case.query.shape[0] + 3, *case.query.shape[1:]), 7.0, device=DEVICE)
    _run(case, launch, DecodeConfig(block_n=16, fused_combine=fused), out)
    n = case.meta.num_real_tokens
    _check(out[:n], reference_output(case), torch.float32)
    assert torch.equal(out[n:], torch.full_like(out[n:], 7.0))


@pytest.mark.filterwarnings("error::RuntimeWarning")
@COMBINE
def test_the_merge_reads_no_partial_of_a_token_past_its_row(fused: bool) -> None:
    """Rows of 1-3 tokens on a grid compiled for 8: a row's merge reads the partial slots of
    its tokens only, none for t >= q_len (other rows' slots, or none written this step). The
    workspace starts at 1e10 with a weight of 2^100, past fp16's range: a merge of such a slot
    overflows the fp16 cast (an error under the CPU interpreter here) even where its store is
    masked."""
    case = _multi_case([(40, 1), (17, 3), (80, 2)], torch.float16)
    launch = _multi_launch(
        case, chunk_len=16, num_sms=16, max_items=max_decode_items(5, 2, 16), max_rows=5, max_query_len=8
    )
    assert launch.schedule.query_len == 8 and launch.schedule.num_partials > 0
    launch.workspace.part_o.fill_(1e10)
    launch.workspace.part_lse.fill_(100.0)  # (log2 units: outweighs any written partial)
    out = _run(case, launch, DecodeConfig(block_n=16, fused_combine=fused))
    _check(out, reference_output(case), torch.float16)


@COMBINE
def test_rows_of_several_new_tokens_under_a_sliding_window(fused: bool) -> None:
    """Each new token sees only the last ``window`` positions up to its own; the positions
    before the first token's window are NaN, so a read of them shows."""
    window = 20
    case = _multi_case([(50, 6), (13, 4), (70, 1)], torch.float32, sliding_window=window)
    ref = reference_output(case)  # before the poison: the oracle multiplies every value by its weight
    bs, kvh, d = case.layer.key.shape[1:]
    for row, (s, q) in enumerate(zip(case.meta.seq_lens_host, case.meta.query_lens_host, strict=True)):
        start = max(0, s - q + 1 - window)
        pos = torch.arange(start, device=case.layer.key.device)
        slots = case.meta.block_tables[row, pos // bs].long() * bs + pos % bs
        case.layer.key.view(-1, kvh, d)[slots] = float("nan")
        case.layer.value.view(-1, kvh, d)[slots] = float("nan")
    launch = _multi_launch(case, window=window, chunk_len=16)
    out = torch.zeros_like(case.query)
    paged_decode(
        case.query, case.layer.key, case.layer.value, case.meta.block_tables, launch.rows, launch.items,
        launch.schedule, launch.workspace, softmax_scale=1.0 / math.sqrt(d), out=out,
        config=DecodeConfig(block_n=16, fused_combine=fused), window=window,
    )  # fmt: skip
    _check(out, ref, torch.float32)


@COMBINE
def test_draft_tree_masks(fused: bool) -> None:
    """A tree of 6 draft tokens (root; two children; a grandchild under each; one more under
    the first) and a chain of 3: each token sees the context and exactly its ancestors."""
    case = _multi_case([(37, 7), (20, 3)], torch.float32)
    # Row 0: token 0 the verified root, 1 and 2 its children, 3 under 1, 4 under 2, 5 under 3,
    # 6 a third child of the root.
    masks = [*ancestor_masks([None, 0, 0, 1, 2, 3, 0]), 0b1, 0b11, 0b111]  # row 1: a chain (the causal case)
    tree = torch.tensor(masks, dtype=torch.int32, device=DEVICE)
    launch = _multi_launch(case, chunk_len=16)
    out = torch.zeros_like(case.query)
    d = case.query.shape[2]
    paged_decode(
        case.query, case.layer.key, case.layer.value, case.meta.block_tables, launch.rows, launch.items,
        launch.schedule, launch.workspace, softmax_scale=1.0 / math.sqrt(d), out=out,
        config=DecodeConfig(block_n=16, fused_combine=fused), tree_masks=tree,
    )  # fmt: skip
    _check(out, tree_reference(case, masks, 1.0 / math.sqrt(d)), torch.float32)
    # The chain row equals plain causal decoding.
    causal = _run(case, launch, DecodeConfig(block_n=16, fused_combine=fused))
    torch.testing.assert_close(out[7:10], causal[7:10], rtol=0, atol=1e-6)
    assert (out[:7] - causal[:7]).abs().max() > 1e-3, "the tree changed nothing"


def _canaried(shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(storage, view): ``view`` of ``shape`` sits inside ``storage`` with one filled slab
    on each side along dim 0."""
    storage = torch.full((shape[0] + 2, *shape[1:]), fill, dtype=dtype, device=DEVICE)
    return storage, storage[1:-1]


# Row 3's NaN output (see below) makes the interpreter's max-reduction warn.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@COMBINE
def test_garbage_metadata_stays_inside_every_tensor(fused: bool) -> None:
    """Out-of-range block ids, table rows, query tokens, kv ends, partial slots, chunk
    counts and row indices: no crash, no NaN from outside the cache (the NaN blocks around
    it), and the slabs around the output and the workspace keep their bits."""
    case = _case([100, 90, 80, 70, 60], heads=4, kv_heads=2, head_dim=32, block_size=32, dtype=torch.float32)
    num_blocks = case.layer.num_blocks
    case.meta.block_tables[1, :3] = torch.tensor([num_blocks, -1, 2**31 - 1], dtype=torch.int32)  # NaN border, huge
    launch = _prepare(case, 16, chunk_len=32)
    s = launch.schedule
    out_store, out = _canaried(tuple(case.query.shape), torch.float32, 3.0)
    po_store, part_o = _canaried(tuple(launch.workspace.part_o.shape), torch.float32, 5.0)
    pl_store, part_lse = _canaried(tuple(launch.workspace.part_lse.shape), torch.float32, 5.0)
    ct_store, counters = _canaried(tuple(launch.workspace.counters.shape), torch.int32, 0)
    ct_store[0], ct_store[-1] = 9, 9
    ws = DecodeWorkspace(part_o=part_o, part_lse=part_lse, counters=counters)
    items, rows = launch.items.clone(), launch.rows.clone()
    by_row = {int(items[i, 0]): i for i in range(s.num_items)}  # one item of each row
    items[by_row[0], 4] = 10**6  # table row out of range
    items[by_row[2], 5] = 10**6  # query token out of range
    items[by_row[3], 2] = 10**9  # kv_end past the table's width: clamped to it, but the
    # row's last block holds never-written (NaN) slots the kernel is now told to read
    split = [i for i in range(s.num_items) if items[i, 3] >= 0]
    items[split[0], 3] = 10**6  # partial slot out of range
    items[split[1], 6:8] = torch.tensor([10**6, -10])  # chunk count and first slot garbage
    items[split[2], 0] = 10**6  # decode row past the counters
    rows[0, 1:4] = torch.tensor([-1, 10**6, -10])
    rows[1, 2:4] = torch.tensor([10**6, s.num_partials - 1])
    bad = dataclasses.replace(launch, items=items, rows=rows, workspace=ws)
    before = [t.clone() for t in (out_store, po_store, pl_store, ct_store)]
    _run(case, bad, DecodeConfig(block_n=16, fused_combine=fused), out)
    assert not out[[0, 1, 2, 4]].isnan().any()
    for store, old in zip((out_store, po_store, pl_store, ct_store), before, strict=True):
        assert torch.equal(store[0], old[0]) and torch.equal(store[-1], old[-1]), "a canary slab changed"


@COMBINE
def test_garbage_multi_token_items_stay_inside_every_tensor(fused: bool) -> None:
    """Rows of several new tokens with garbage: a chunk count whose product with the token
    index wraps int32 negative, query lengths and row ends out of range, a first partial
    slot near the int32 limit. No crash, and the slabs around the output and workspace keep
    their bits."""
    case = _multi_case(MULTI_ROWS, torch.float32)
    launch = _multi_launch(case, chunk_len=16)
    s = launch.schedule
    out_store, out = _canaried(tuple(case.query.shape), torch.float32, 3.0)
    po_store, part_o = _canaried(tuple(launch.workspace.part_o.shape), torch.float32, 5.0)
    pl_store, part_lse = _canaried(tuple(launch.workspace.part_lse.shape), torch.float32, 5.0)
    ct_store, counters = _canaried(tuple(launch.workspace.counters.shape), torch.int32, 0)
    ws = DecodeWorkspace(part_o=part_o, part_lse=part_lse, counters=counters)
    items, rows = launch.items.clone(), launch.rows.clone()
    split = [i for i in range(s.num_items) if items[i, 3] >= 0 and items[i, 8] > 2]
    assert len(split) >= 3, "the case should split rows of several tokens"
    items[split[0], 6] = 2**30  # t * num_chunks wraps past int32 for t >= 2
    items[split[1], 8:10] = torch.tensor([10**6, -5])  # q_len and row end out of range
    items[split[2], 3] = 2**31 - 3  # partial slot at the int32 limit
    rows[0, 2:5] = torch.tensor([2**30, 0, 10**6])  # the combine: chunk count, first slot, q_len
    bad = dataclasses.replace(launch, items=items, rows=rows, workspace=ws)
    before = [t.clone() for t in (out_store, po_store, pl_store, ct_store)]
    _run(case, bad, DecodeConfig(block_n=16, fused_combine=fused), out)
    for store, old in zip((out_store, po_store, pl_store, ct_store), before, strict=True):
        assert torch.equal(store[0], old[0]) and torch.equal(store[-1], old[-1]), "a canary slab changed"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("short", "tree_masks: 3 entries for 23 query tokens"),
        ("dtype", "tree_masks: expected int32"),
        ("window", "tree_masks: not with a sliding window"),
        ("bad_window", "window: 0 must be >= 1"),
    ],
)
def test_launcher_rejects_bad_tree_masks_and_windows(change: str, message: str) -> None:
    case = _multi_case(MULTI_ROWS, torch.float32)
    launch = _multi_launch(case, chunk_len=16)
    tree: torch.Tensor | None = torch.full((case.query.shape[0],), 0xFF, dtype=torch.int32, device=DEVICE)
    window: int | None = None
    if change == "short":
        tree = tree[:3]  # type: ignore[index]
    elif change == "dtype":
        tree = tree.long()  # type: ignore[union-attr]
    elif change == "window":
        window = 16
    else:
        tree, window = None, 0
    with pytest.raises(ValueError, match=message):
        paged_decode(
            case.query, case.layer.key, case.layer.value, case.meta.block_tables, launch.rows, launch.items,
            launch.schedule, launch.workspace, softmax_scale=0.1, out=torch.zeros_like(case.query),
            config=DecodeConfig(block_n=16), tree_masks=tree, window=window,
        )  # fmt: skip


@pytest.mark.parametrize("query_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("f16_dots", [True, False], ids=["f16-dots", "query-dtype-dots"])
def test_fp8_cache_with_per_head_scales(query_dtype: torch.dtype, f16_dots: bool) -> None:
    """float8_e4m3fn K/V with fp32 per-KV-head scales, 16-bit queries, dots in fp16 or in the
    query's dtype (runs in the interpreter)."""
    case = _case([45, 130, 7], heads=8, kv_heads=2, head_dim=64, block_size=32, dtype=torch.float32)
    k8, v8 = (c.nan_to_num(0.0).to(torch.float8_e4m3fn) for c in (case.layer.key, case.layer.value))
    query = case.query.to(query_dtype)
    fp8 = dataclasses.replace(case, layer=dataclasses.replace(case.layer, key=k8, value=v8), query=query)
    k_scale, v_scale = torch.tensor([0.5, 2.0], device=DEVICE), torch.tensor([1.5, 0.25], device=DEVICE)
    launch = _prepare(fp8, 32, chunk_len=64)
    out = _run(fp8, launch, DecodeConfig(block_n=32, f16_fp8_dots=f16_dots), scales=(k_scale, v_scale))
    ranges = [(0, n) for n in case.meta.seq_lens_host]
    deq = dataclasses.replace(fp8, layer=dataclasses.replace(case.layer, key=k8.float(), value=v8.float()))
    ref = _reference(deq, ranges, [0, 1, 2], [0, 1, 2], 1 / math.sqrt(64), (k_scale, v_scale))
    _check(out, ref, query_dtype)


@pytest.mark.parametrize(
    ("block_size", "block_n", "head_dim"),
    [
        pytest.param(32, 32, 64, id="tile-is-a-block"),
        pytest.param(64, 32, 72, id="tile-inside-a-block-d72"),
        pytest.param(32, 64, 64, id="tile-spans-blocks"),
        pytest.param(96, 64, 64, id="block-96-runs-of-32"),
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float16], ids=["fp8", "fp16"])
def test_token_major_values(cache_dtype: torch.dtype, block_size: int, block_n: int, head_dim: int) -> None:
    """A token-major V (``attention.value_layout``; kvcache allocates 8-bit caches so) whose
    stale slots hold NaN: the kernel reads V tiles unmasked inside valid blocks, and a NaN
    there, times a probability of 0, must not reach the output. (fp16 as well as fp8: the
    CPU interpreter converts an fp8 NaN to a finite value, so there only fp16 shows it.)"""
    case = _case([45, 130, 7, 200], heads=8, kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=torch.float32)
    fp8 = cache_dtype == torch.float8_e4m3fn
    key = case.layer.key.nan_to_num(0.0).to(cache_dtype)
    value = case.layer.value.to(cache_dtype)  # unwritten slots stay NaN
    assert value.float().isnan().any()
    v_token_major = token_major_view(torch.empty_like(value))
    v_token_major.copy_(value)
    assert is_token_major(v_token_major)
    query = case.query.to(torch.bfloat16 if fp8 else torch.float16)
    layer = dataclasses.replace(case.layer, key=key, value=v_token_major)
    scales = (torch.tensor([0.5, 2.0], device=DEVICE), torch.tensor([1.5, 0.25], device=DEVICE)) if fp8 else None
    token_major = dataclasses.replace(case, layer=layer, query=query)
    launch = _prepare(token_major, block_n, chunk_len=2 * block_n)
    out = _run(token_major, launch, DecodeConfig(block_n=block_n), scales=scales)
    ranges = [(0, n) for n in case.meta.seq_lens_host]
    plain = dataclasses.replace(case, layer=dataclasses.replace(case.layer, key=key.float(), value=value.float()))
    scale = 1 / math.sqrt(head_dim)
    ref = _reference(dataclasses.replace(plain, query=query), ranges, [0, 1, 2, 3], [0, 1, 2, 3], scale, scales)
    _check(out, ref, query.dtype)


def test_fp8_cache_clamps_queries_past_the_fp16_range() -> None:
    """A bf16 query beyond fp16's range stays finite under fp16 dots: it is clamped to 65504,
    the attention of the clamped query (the scores stay finite in fp32)."""
    case = _case([40, 9], heads=4, kv_heads=1, head_dim=32, block_size=32, dtype=torch.float32)
    k8, v8 = (c.nan_to_num(0.0).to(torch.float8_e4m3fn) for c in (case.layer.key, case.layer.value))
    query = case.query.to(torch.bfloat16)
    query[0, 1, 3] = 1.0e6  # past fp16's 65504
    fp8 = dataclasses.replace(case, layer=dataclasses.replace(case.layer, key=k8, value=v8), query=query)
    ones = torch.ones(1, device=DEVICE)
    launch = _prepare(fp8, 32, chunk_len=64)
    out = torch.zeros_like(query)
    paged_decode(
        query, k8, v8, case.meta.block_tables, launch.rows, launch.items, launch.schedule, launch.workspace,
        softmax_scale=1e-6, out=out, config=DecodeConfig(block_n=32), k_scale=ones, v_scale=ones,
    )  # fmt: skip
    assert torch.isfinite(out[:2]).all()
    clamped = dataclasses.replace(fp8, query=query.float().clamp(-65504, 65504))
    ranges = [(0, n) for n in case.meta.seq_lens_host]
    deq = dataclasses.replace(clamped, layer=dataclasses.replace(case.layer, key=k8.float(), value=v8.float()))
    ref = _reference(deq, ranges, [0, 1], [0, 1], 1e-6, (ones, ones))
    _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("block_n", "chunk_len 32 is not a multiple of config.block_n 64"),
        ("workspace", "partial slots, the schedule uses"),
        ("items", "items: 1 entries, the schedule's grid needs"),
        ("q_token", "names query token 2, query has 2"),
        ("fp8_no_scale", "an fp8 cache needs fp32"),
        ("scale_not_fp8", "scales apply only to fp8 caches"),
    ],
)
def test_launcher_rejects_inconsistent_arguments(change: str, message: str) -> None:
    case = _case([50, 20, 3], heads=4, kv_heads=2, head_dim=16, block_size=32, dtype=torch.float16)
    launch = _prepare(case, 16, chunk_len=32)
    config, k_cache, v_cache, query = DecodeConfig(block_n=16), case.layer.key, case.layer.value, case.query
    scales: dict[str, torch.Tensor] = {}
    if change == "block_n":
        config = DecodeConfig(block_n=64)
    elif change == "workspace":
        launch.workspace = allocate_decode_workspace(
            max_rows=3, max_partials=1, num_heads=4, num_kv_heads=2, head_dim=16, device=DEVICE
        )
    elif change == "items":
        launch.items = launch.items[:1]
    elif change == "q_token":
        query = query[:2]
    elif change == "fp8_no_scale":
        k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    else:
        scales = {"k_scale": torch.ones(2, device=DEVICE), "v_scale": torch.ones(2, device=DEVICE)}
    with pytest.raises(ValueError, match=message):
        paged_decode(
            query,
            k_cache,
            v_cache,
            case.meta.block_tables,
            launch.rows,
            launch.items,
            launch.schedule,
            launch.workspace,
            softmax_scale=0.25,
            out=torch.zeros_like(query),
            config=config,
            **scales,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@COMBINE
def test_decode_graph_replays_later_steps_on_a_fixed_grid(fused: bool) -> None:
    """Capture one decode launch for a bucket of 8 rows, then replay it for steps with other
    rows, lengths and chunkings: only the persistent metadata buffers change (a graph's
    launches keep their grid and arguments). Fused counters are back at 0 after each."""
    lens = [4096, 31, 701, 2048, 2, 9001, 257, 5001]
    case = _case(lens, heads=8, kv_heads=2, head_dim=128, block_size=32, dtype=torch.bfloat16, device="cuda")
    kvh, heads, d = 2, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bucket, config = 8, DecodeConfig(block_n=64, fused_combine=fused)
    cap_items = max_decode_items(bucket, kvh, sms)
    rows_buf = torch.zeros((bucket, ROW_FIELDS), dtype=torch.int32, device="cuda")
    items_buf = torch.zeros((cap_items, ITEM_FIELDS), dtype=torch.int32, device="cuda")
    workspace = allocate_decode_workspace(
        max_rows=bucket,
        max_partials=max_decode_partials(bucket, kvh, sms),
        num_heads=heads,
        num_kv_heads=kvh,
        head_dim=d,
        device="cuda",
    )
    scale = d**-0.5

    def schedule(table_rows: list[int]) -> DecodeSchedule:
        return schedule_decode(
            [(0, lens[r]) for r in table_rows],
            num_kv_heads=kvh,
            num_sms=sms,
            block_n=config.block_n,
            max_items=cap_items,
            max_rows=bucket,
            table_rows=table_rows,
            q_tokens=list(range(len(table_rows))),
        )

    out = torch.zeros_like(case.query)
    first = schedule([0, 1, 2])
    decode_metadata(first, "cuda", rows_out=rows_buf, items_out=items_buf)

    def launch() -> None:
        paged_decode(case.query, case.layer.key, case.layer.value, case.meta.block_tables, rows_buf, items_buf,
                     first, workspace, softmax_scale=scale, out=out, config=config)  # fmt: skip

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for table_rows in ([0, 1, 2], [7, 6, 5, 4, 3, 2, 1, 0], [5], [3, 5, 7, 0, 1]):
        step = schedule(table_rows)
        decode_metadata(step, "cuda", rows_out=rows_buf, items_out=items_buf)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        n = len(table_rows)
        expect = _reference(case, [(0, lens[r]) for r in table_rows], table_rows, list(range(n)), scale)
        assert rel_err(out[:n], expect) < 2e-2, f"step {table_rows}"  # bf16: as the contract's GPU cases
        assert not out[n:].any(), "a token no row names was written"
        assert not workspace.counters.any()
