"""The triton backend against the float64 reference, on small shapes.

Without a GPU this runs the real kernels in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes stay small; on a CUDA machine the same tests run on the GPU.

Every case goes through a real BlockManager with a scrambled free queue (shuffled,
non-contiguous block ids), a NaN-poisoned cache (reading a slot that was never written turns
the output NaN, which never passes a comparison), and writes the step's new K/V with the
backend's own cache-write kernel before attending.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention import AttentionMetadata, get_backend
from attention.triton_backend import TritonBackend, TritonStepPlan
from attention.triton_kernels import (
    DecodeConfig,
    PrefillConfig,
    default_prefill_config,
    prefill_tile_index,
)
from tests.paged_case import PagedCase, make_case, reference_output

# Element-wise tolerances against a float64 oracle on the same (rounded) inputs; outputs are
# O(1). fp32: summation order (~1e-6; on a GPU also tf32x3 products, ~2^-21 each). fp16: P
# is rounded to 11 bits before the P@V product and the output is stored in fp16 (~5e-4
# relative each). bf16: the same with 8 bits (~4e-3 each).
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}

ODD = [1, 31, 32, 33, 97]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN == NaN and -0.0 != 0.0 in comparisons."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _fresh_new_tokens(case: PagedCase) -> None:
    """Poison the step's new slots again, so only the backend's own write can fill them."""
    kvh, d = case.k_cache.shape[2:]
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, kvh, d)[case.meta.slot_mapping] = float("nan")


def _with_nan_border(case: PagedCase) -> PagedCase:
    """Move the caches into storage with one NaN block before and after them: a kernel that
    dereferenced PAD_BLOCK (-1) or ran past the last block would read NaN."""
    n, bs, kvh, d = case.k_cache.shape
    storage = torch.full((2, n + 2, bs, kvh, d), float("nan"), dtype=case.k_cache.dtype, device=case.k_cache.device)
    storage[0, 1:-1] = case.k_cache
    storage[1, 1:-1] = case.v_cache
    return dataclasses.replace(case, k_cache=storage[0, 1:-1], v_cache=storage[1, 1:-1])


def _widen_tables(meta: AttentionMetadata, extra: int) -> AttentionMetadata:
    pad = torch.full((meta.batch, extra), -1, dtype=torch.int32, device=meta.device)
    return dataclasses.replace(meta, block_tables=torch.cat([meta.block_tables, pad], dim=1))


def _run(
    backend: TritonBackend,
    rows: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, TritonStepPlan]:
    """Write the step's K/V and attend with ``backend``; return (output, oracle, plan)."""
    case = make_case(
        rows,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=seed,
        spare_blocks=3,
    )
    case = _with_nan_border(case)
    case = dataclasses.replace(case, meta=_widen_tables(case.meta, 2))
    _fresh_new_tokens(case)
    backend.write_kv(case.new_key, case.new_value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    plan = backend.plan(case.meta)
    assert isinstance(plan, TritonStepPlan)
    out = backend.attend(case.query, case.k_cache, case.v_cache, plan)
    return out, reference_output(case), plan


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "NaN in the output: a kernel read an unwritten slot"
    torch.testing.assert_close(out.double(), ref.double(), **TOLERANCE[dtype])


# ---- cache write -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [32, 64])
def test_write_kv_writes_exactly_the_given_slots(dtype: torch.dtype, block_size: int, triton_device: str) -> None:
    kvh, d, blocks = 3, 40, 4  # head_dim 40 pads to 64 lanes in the kernel
    k_cache = torch.full((blocks, block_size, kvh, d), float("nan"), dtype=dtype, device=triton_device)
    v_cache = k_cache.clone()
    slots = torch.tensor([5, -1, 3 * block_size + 7, block_size, -1, blocks * block_size - 1], device=triton_device)
    # Views into a fused projection: token stride 2 * kvh * d, not contiguous.
    fused = torch.randn(len(slots), 2, kvh, d).to(dtype=dtype, device=triton_device)
    key, value = fused[:, 0], fused[:, 1]
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expect_k.view(-1, kvh, d)[slots[keep]] = key[keep]
    expect_v.view(-1, kvh, d)[slots[keep]] = value[keep]
    TritonBackend().write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(_bits(k_cache), _bits(expect_k))
    assert torch.equal(_bits(v_cache), _bits(expect_v))


def test_write_kv_skips_slots_outside_the_cache(triton_device: str) -> None:
    k_cache = torch.zeros((2, 32, 1, 8), device=triton_device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones((2, 1, 8), device=triton_device)
    slots = torch.tensor([64, 10], device=triton_device)  # 64 is one past the last slot
    TritonBackend().write_kv(key, key, k_cache, v_cache, slots)
    assert k_cache.sum().item() == 8 and k_cache[0, 10].sum().item() == 8


# ---- decode ------------------------------------------------------------------------------

DECODE_CASES = [
    # dtype, block_size, heads, kv_heads (GQA = heads / kv_heads), head_dim, context lengths
    pytest.param(torch.float32, 32, 4, 4, 64, ODD, id="fp32-bs32-gqa1-d64"),
    pytest.param(torch.float16, 64, 8, 2, 128, [0, 33, 97, 200], id="fp16-bs64-gqa4-d128"),
    pytest.param(torch.bfloat16, 256, 8, 1, 64, [30, 300, 96], id="bf16-bs256-gqa8-d64"),
    pytest.param(torch.bfloat16, 32, 16, 2, 256, [0, 31, 65], id="bf16-bs32-gqa8-d256"),
    pytest.param(torch.float16, 32, 6, 3, 40, [2, 32, 96], id="fp16-bs32-gqa2-d40"),
    pytest.param(torch.float32, 96, 4, 2, 96, [95, 96, 191], id="fp32-bs96-gqa2-d96"),
]


@pytest.mark.parametrize(("dtype", "block_size", "heads", "kv_heads", "head_dim", "contexts"), DECODE_CASES)
@pytest.mark.parametrize("chunk_len", [None, 10**6, 32], ids=["policy", "whole-rows", "one-tile-chunks"])
def test_decode_matches_reference(
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    contexts: list[int],
    chunk_len: int | None,
    triton_device: str,
) -> None:
    # 32 is rounded up to the tile (block_n), so long rows split into one-tile chunks.
    backend = TritonBackend(decode_chunk_len=chunk_len)
    rows = [(c, 1) for c in contexts]
    out, ref, plan = _run(
        backend,
        rows,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=triton_device,
    )
    assert plan.use_decode
    _check(out, ref, dtype)


@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
@pytest.mark.parametrize("block_size", [32, 64])
def test_decode_tile_sizes(block_n: int, block_size: int, triton_device: str) -> None:
    """Tiles inside one block (one table read) and tiles spanning blocks (per-token reads)."""
    backend = TritonBackend(decode_config=DecodeConfig(block_n=block_n), decode_chunk_len=64)
    out, ref, _ = _run(
        backend,
        [(c, 1) for c in (0, 63, 64, 150)],
        heads=4,
        kv_heads=2,
        head_dim=32,
        block_size=block_size,
        dtype=torch.float32,
        device=triton_device,
    )
    _check(out, ref, torch.float32)


def test_decode_chunks_of_one_tile(triton_device: str) -> None:
    """Many chunks per long row, one for short rows (the combine step skips those)."""
    backend = TritonBackend(decode_config=DecodeConfig(block_n=16), decode_chunk_len=16)
    out, ref, _ = _run(
        backend,
        [(0, 1), (17, 1), (250, 1)],
        heads=2,
        kv_heads=1,
        head_dim=16,
        block_size=32,
        dtype=torch.float16,
        device=triton_device,
    )
    _check(out, ref, torch.float16)


# ---- prefill / extend / mixed ----------------------------------------------------------

PREFILL_CASES = [
    pytest.param(torch.float32, 32, 4, 4, 64, [(0, n) for n in ODD], id="fp32-prompts-gqa1"),
    pytest.param(torch.float16, 64, 8, 2, 128, [(40, 33), (96, 1), (0, 70), (5, 1)], id="fp16-mixed-gqa4"),
    pytest.param(torch.bfloat16, 256, 8, 1, 64, [(200, 57), (0, 1), (31, 2)], id="bf16-extend-gqa8"),
    pytest.param(torch.bfloat16, 32, 4, 2, 256, [(0, 40), (33, 20)], id="bf16-d256"),
    pytest.param(torch.float16, 32, 6, 3, 40, [(10, 50), (0, 31)], id="fp16-d40"),
]


@pytest.mark.parametrize(("dtype", "block_size", "heads", "kv_heads", "head_dim", "rows"), PREFILL_CASES)
def test_prefill_matches_reference(
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rows: list[tuple[int, int]],
    triton_device: str,
) -> None:
    backend = TritonBackend()
    out, ref, plan = _run(
        backend,
        rows,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=triton_device,
    )
    assert not plan.use_decode
    _check(out, ref, dtype)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (16, 64), (64, 16), (32, 32)])
@pytest.mark.parametrize("block_size", [32, 64])
def test_prefill_tile_sizes(block_m: int, block_n: int, block_size: int, triton_device: str) -> None:
    """Many query tiles per row, key tiles smaller and larger than a block, diagonal tiles
    that start mid-tile (cached prefix not a multiple of the tile)."""
    backend = TritonBackend(prefill_config=PrefillConfig(block_m=block_m, block_n=block_n))
    rows = [(0, 97), (45, 40), (100, 1), (7, 33)]
    out, ref, _ = _run(
        backend,
        rows,
        heads=4,
        kv_heads=2,
        head_dim=16,
        block_size=block_size,
        dtype=torch.float32,
        device=triton_device,
    )
    _check(out, ref, torch.float32)


def test_prefill_writes_nothing_for_padding_tokens(triton_device: str) -> None:
    """Padded query rows (slot -1) get no K/V written and do not disturb real rows."""
    case = make_case(
        [(20, 13), (0, 40)],
        heads=4,
        kv_heads=2,
        head_dim=32,
        block_size=32,
        dtype=torch.float16,
        device=triton_device,
        spare_blocks=3,
    )
    _fresh_new_tokens(case)
    pad = 5
    meta = dataclasses.replace(
        case.meta,
        slot_mapping=torch.cat(
            [
                case.meta.slot_mapping,
                torch.full((pad,), -1, dtype=torch.int64, device=triton_device),
            ]
        ),
    )
    query = torch.cat([case.query, torch.randn(pad, 4, 32).to(case.query)])
    key = torch.cat([case.new_key, torch.randn(pad, 2, 32).to(case.new_key)])
    backend = TritonBackend()
    before = case.k_cache.clone()
    backend.write_kv(key, key, case.k_cache, case.v_cache, meta.slot_mapping)
    changed = (_bits(before) != _bits(case.k_cache)).any(dim=(2, 3)).flatten().nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(case.meta.slot_mapping.tolist())
    backend.write_kv(case.new_key, case.new_value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = backend.attend(query, case.k_cache, case.v_cache, backend.plan(meta))
    n = case.meta.num_tokens
    _check(out[:n], reference_output(case), torch.float16)


# ---- call options ------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [[(30, 1), (64, 1)], [(30, 5), (0, 1)]], ids=["decode", "prefill"])
def test_out_argument_scale_and_strided_query(rows: list[tuple[int, int]], triton_device: str) -> None:
    case = make_case(
        rows,
        heads=4,
        kv_heads=2,
        head_dim=16,
        block_size=32,
        dtype=torch.float32,
        device=triton_device,
    )
    fused = torch.randn(case.meta.num_tokens, 3, 4, 16, device=triton_device)
    fused[:, 1] = case.query
    query = fused[:, 1]  # token stride 3 * 4 * 16
    strided_out = torch.zeros(case.meta.num_tokens, 4, 32, device=triton_device)[:, :, ::2]
    backend = TritonBackend()
    got = backend.attend(
        query,
        case.k_cache,
        case.v_cache,
        backend.plan(case.meta),
        softmax_scale=0.3,
        out=strided_out,
    )
    assert got is strided_out
    _check(got, reference_output(case, scale=0.3), torch.float32)


# ---- planning ------------------------------------------------------------------------------


def test_prefill_tile_index_covers_every_tile_heaviest_first() -> None:
    seq_lens, query_lens = (100, 1, 300, 64), (100, 1, 40, 64)
    tiles = prefill_tile_index(seq_lens, query_lens, 32)
    expect = {(r, t) for r, q in enumerate(query_lens) for t in range(-(-q // 32))}
    assert sorted(tiles) == sorted(expect) and len(tiles) == len(expect)
    work = [seq_lens[r] - query_lens[r] + min((t + 1) * 32, query_lens[r]) for r, t in tiles]
    assert work == sorted(work, reverse=True)


def test_plan_is_derived_once_per_step(triton_device: str) -> None:
    case = make_case(
        [(10, 5), (3, 1), (0, 2), (7, 1)],
        heads=2,
        kv_heads=1,
        head_dim=16,
        block_size=32,
        dtype=torch.float32,
        device=triton_device,
    )
    backend = TritonBackend()
    plan = backend.plan(case.meta)
    assert isinstance(plan, TritonStepPlan) and not plan.use_decode
    # One-token rows go to the decode kernel, at their query tokens; the rest to prefill.
    assert plan.decode_rows == (1, 3) and plan.prefill_rows == (0, 2)
    # Decode row d reads table row decode_rows[d] and owns its query token.
    schedule = plan.decode_schedule(1, 16)
    assert [schedule.row(d)[:2] for d in range(2)] == [(1, 5), (3, 8)]
    assert plan.decode_schedule(1, 16) is schedule  # every layer reuses the same schedule
    assert plan.decode_launch(2, 1, 16, 16) is plan.decode_launch(2, 1, 16, 16)
    assert plan.tile_index(64) is plan.tile_index(64)
    expect = prefill_tile_index((15, 4, 2, 8), (5, 1, 2, 1), 16, rows=(0, 2))
    assert plan.tile_index(16).tolist() == [list(p) for p in expect] == [[0, 0], [2, 0]]
    assert plan.decode_max_seq_len == 8 and plan.prefill_max_query_len == 5
    pure = backend.plan(
        make_case(
            [(5, 1)], heads=2, kv_heads=1, head_dim=16, block_size=32, dtype=torch.float32, device=triton_device
        ).meta
    )
    assert isinstance(pure, TritonStepPlan) and pure.use_decode and pure.decode_schedule(1, 16).row(0)[:2] == (0, 0)
    assert get_backend("triton").plan(case.meta).num_sms > 0


def test_prefill_tile_shrinks_to_short_rows() -> None:
    assert default_prefill_config(128, torch.bfloat16).block_m == 128
    short = default_prefill_config(128, torch.bfloat16, max_query_len=5)
    assert (short.block_m, short.num_warps) == (16, 4)
    assert default_prefill_config(128, torch.bfloat16, max_query_len=100).block_m == 128
    assert default_prefill_config(128, torch.bfloat16, max_query_len=64).block_m == 64


def test_mixed_batch_with_forced_chunks(triton_device: str) -> None:
    """Decode rows of a mixed batch run chunked (their table rows and query tokens named in
    the items), prefill rows beside."""
    backend = TritonBackend(decode_config=DecodeConfig(block_n=16), decode_chunk_len=32)
    rows = [(60, 1), (20, 30), (0, 1), (95, 1), (5, 17)]
    out, ref, plan = _run(
        backend,
        rows,
        heads=4,
        kv_heads=2,
        head_dim=32,
        block_size=32,
        dtype=torch.bfloat16,
        device=triton_device,
    )
    assert plan.decode_rows == (0, 2, 3) and plan.prefill_rows == (1, 4)
    _check(out, ref, torch.bfloat16)


# ---- argument checks (before any kernel runs) ------------------------------------------


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every kernel launch fail, to prove the checks fire first."""

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was launched before the arguments were rejected")

    for name in ("paged_decode", "paged_prefill", "write_kv_cache"):
        monkeypatch.setattr(f"attention.triton_backend.{name}", launched)


def _small(device: str, **overrides: object) -> dict[str, object]:
    case = make_case(
        [(5, 1)],
        heads=4,
        kv_heads=2,
        head_dim=16,
        block_size=32,
        dtype=torch.float16,
        device=device,
    )
    args: dict[str, object] = {
        "query": case.query,
        "k_cache": case.k_cache,
        "v_cache": case.v_cache,
        "meta": case.meta,
    }
    args.update(overrides)
    return args


def _attend(backend: TritonBackend, args: dict[str, object]) -> None:
    meta = args["meta"]
    assert isinstance(meta, AttentionMetadata)
    backend.attend(args["query"], args["k_cache"], args["v_cache"], backend.plan(meta))  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("query_dtype", "query: expected dtype"),
        ("query_heads", "not a multiple of the cache's 2 KV heads"),
        ("query_tokens", "query: expected shape"),
        ("block_size_48", "block_size 48 is refused"),
        ("head_dim_12", "head_dim 12 is refused"),
        ("head_dim_264", "head_dim 264 is refused"),
        ("float64", "dtype torch.float64 is refused"),
        ("non_contiguous", "expected contiguous"),
    ],
)
def test_bad_arguments_raise_before_any_kernel(change: str, message: str, triton_device: str) -> None:
    args = _small(triton_device)
    q, k = args["query"], args["k_cache"]
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    dev = triton_device
    if change == "query_dtype":
        args["query"] = q.float()
    elif change == "query_heads":
        args["query"] = torch.zeros(q.shape[0], 3, 16, dtype=q.dtype, device=dev)
    elif change == "query_tokens":
        args["query"] = q[:0]
    elif change in ("block_size_48", "head_dim_12", "head_dim_264", "float64"):
        shape = {
            "block_size_48": (4, 48, 2, 16),
            "head_dim_12": (4, 32, 2, 12),
            "head_dim_264": (4, 32, 2, 264),
        }.get(change, tuple(k.shape))
        dtype = torch.float64 if change == "float64" else k.dtype
        args["k_cache"] = args["v_cache"] = torch.zeros(shape, dtype=dtype, device=dev)
    elif change == "non_contiguous":
        args["k_cache"] = args["v_cache"] = k.transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match=message):
        _attend(TritonBackend(), args)


@pytest.mark.usefixtures("no_kernels")
def test_write_kv_checks_slot_mapping_dtype(triton_device: str) -> None:
    k = torch.zeros(2, 32, 1, 8, device=triton_device)
    key = torch.zeros(3, 1, 8, device=triton_device)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=triton_device)
    with pytest.raises(ValueError, match=r"slot_mapping: expected dtype torch\.int64"):
        TritonBackend().write_kv(key, key, k, k.clone(), slots)


@pytest.mark.usefixtures("no_kernels")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backend = TritonBackend()
    with pytest.raises(ValueError, match=r"needs CUDA tensors; set TRITON_INTERPRET=1"):
        backend._device_type_for_checks("cpu")
    args = _small("cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        _attend(backend, args)


@pytest.mark.usefixtures("no_kernels")
def test_interpreter_requested_after_import_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("attention.triton_backend.kernels_interpreted", lambda: False)
    with pytest.raises(ValueError, match=r"before importing attention\.triton_backend"):
        TritonBackend()._device_type_for_checks("cpu")
