"""The Hopper (sm_90) prefill kernel (attention/triton_kernels/prefill_hopper.py): through the
triton backend against the float64 oracle, on the rows it serves (odd prompt and extend
lengths, partial last blocks whose stale slots are NaN, GQA ratios, head_dim 64 and 128,
bf16 and fp16), and called directly with hostile metadata (memory safety, rows outside the
step untouched). Needs an sm_90 GPU and a Triton with Gluon; skipped with the reason
otherwise. tests/test_prefill_hopper_compile.py compiles it for sm_90 without a GPU."""

from __future__ import annotations

import pytest
import torch

import attention.triton_backend as triton_backend
from attention.triton_backend import TritonBackend
from attention.triton_kernels import MAX_DECODE_QUERY_LEN, prefill_tile_index
from attention.triton_kernels.prefill_hopper import HOPPER_PREFILL_BLOCK_M, gluon_available, hopper_prefill
from tests.paged_case import make_case, make_spec, reference_output, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="the Hopper prefill kernel runs on sm_90 only",
    ),
    pytest.mark.skipif(not gluon_available(), reason="needs a Triton with Gluon (>= 3.6), compiled kernels"),
]

# (context, new) per row: prompts and extend chunks of odd lengths, a one-token row (decode).
ROWS = [(0, 300), (200, 77), (0, 129), (511, 1), (1000, 257), (0, 5)]


@pytest.fixture
def hopper_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the backend's calls of the Hopper kernel."""
    calls: list[int] = []

    def counted(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        return hopper_prefill(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "hopper_prefill", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 128), (16, 16, 64), (32, 4, 128), (9, 3, 64)])
@pytest.mark.parametrize("block_size", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("sms", [None, 3])
def test_backend_prefill_matches_float64(
    hopper_calls: list[int],
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    sms: int | None,
) -> None:
    """``sms`` 3: three persistent programs take every item in turn (the K/V ring and the Q
    buffer wrap across items). Blocks of 32, 64 and 96 load each 128-key tile as 4, 2 and 4
    boxes from scattered blocks."""
    spec = make_spec(heads, kv_heads, head_dim, dtype)
    case = make_case(ROWS, spec, block_size=block_size, device="cuda", seed=heads + block_size)
    backend = TritonBackend(spec, num_sms=sms)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    out = backend.attend(case.query, case.layer, plan)
    assert hopper_calls, "the step should have run on the Hopper kernel"
    err = rel_err(out[: case.meta.num_real_tokens].float(), reference_output(case))
    assert err < 1e-2, err


def test_backend_falls_back_where_the_kernel_does_not_apply(hopper_calls: list[int]) -> None:
    """A sliding window, head_dim 256 and hopper_prefill=False keep the Triton kernel (and
    still match the oracle)."""
    cases = [
        (make_spec(8, 2, 128, torch.bfloat16, sliding_window=100), 256, True),
        (make_spec(4, 2, 256, torch.bfloat16), 32, True),
        (make_spec(8, 2, 128, torch.bfloat16), 256, False),
    ]
    for spec, block_size, enabled in cases:
        case = make_case(ROWS[:3], spec, block_size=block_size, device="cuda")
        backend = TritonBackend(spec, hopper_prefill=enabled)
        plan = backend.plan(case.meta)
        backend.write_kv(case.new_key, case.new_value, case.layer, plan)
        out = backend.attend(case.query, case.layer, plan)
        err = rel_err(out[: case.meta.num_real_tokens].float(), reference_output(case))
        assert err < (6e-2 if spec.quantized_cache else 1e-2), (spec, block_size, err)
    assert not hopper_calls


@pytest.mark.parametrize("cache", ["float8_e4m3", "int8"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(8, 2, 128, 256), (9, 3, 64, 128), (8, 2, 128, 32)]
)
def test_8_bit_cache_through_a_dequantized_copy(
    hopper_calls: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, cache: str
) -> None:
    """An eager step over an fp8 or int8 cache (V token-major, as kvcache allocates it) runs on
    the Hopper kernel over a 16-bit copy of the blocks its rows read, and matches the oracle on
    the dequantized cache."""
    spec = make_spec(heads, kv_heads, head_dim, torch.bfloat16, kv_cache_dtype=cache)
    case = make_case(ROWS, spec, block_size=block_size, device="cuda", seed=11)
    backend = TritonBackend(spec)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    out = backend.attend(case.query, case.layer, plan)
    assert hopper_calls, "the step should have run on the Hopper kernel"
    err = rel_err(out[: case.meta.num_real_tokens].float(), reference_output(case))
    assert err < 1e-2, err


@pytest.mark.parametrize("cache", ["float8_e4m3", "int8"])
@pytest.mark.parametrize("block_size", [32, 256])
def test_graph_step_over_a_dequantized_copy(hopper_calls: list[int], block_size: int, cache: str) -> None:
    """``graph_dequant_prefill``: a mixed CUDA-graph step over an 8-bit cache (padded to a
    bucket of 6 rows and 640 tokens) copies its prefill rows' blocks on a fixed grid up to the
    count on the device and runs them on the Hopper kernel's fixed grid: the oracle's output,
    and the same launches captured in a CUDA graph and replayed write the same."""
    spec = make_spec(8, 2, 128, torch.bfloat16, kv_cache_dtype=cache)
    rows = [(0, 300), (200, 77), (511, 1), (0, 129)]
    case = make_case(rows, spec, block_size=block_size, device="cuda", seed=12, pad_to=6, pad_tokens=640)
    backend = TritonBackend(spec, graph_dequant_prefill=True)
    plan = backend.plan(case.meta, graph=True)
    assert plan.prefill is not None and plan.prefill.dequant is not None  # type: ignore[attr-defined]
    assert plan.prefill.dequant.count is not None  # type: ignore[attr-defined]
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    out = backend.attend(case.query, case.layer, plan)
    assert hopper_calls, "the prefill rows should have run on the Hopper kernel"
    real = case.meta.num_real_tokens
    err = rel_err(out[:real].float(), reference_output(case))
    assert err < 1e-2, err
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend.attend(case.query, case.layer, plan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[:real], out[:real])


@pytest.mark.parametrize("block_size", [32, 256])
def test_fixed_grid_matches_the_eager_launch(block_size: int) -> None:
    """The CUDA-graph form (a fixed grid, the real entry count on the device, the index
    padded with row -1) writes what the eager launch writes, captured and replayed."""
    spec = make_spec(16, 4, 128, torch.bfloat16)
    case = make_case(ROWS, spec, block_size=block_size, device="cuda", seed=5)
    backend = TritonBackend(spec)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    eager = backend.attend(case.query, case.layer, plan)
    pairs = prefill_tile_index(case.meta.seq_lens_host, case.meta.query_lens_host, HOPPER_PREFILL_BLOCK_M)
    pairs = [p for p in pairs if case.meta.query_lens_host[p[0]] > MAX_DECODE_QUERY_LEN]  # as the backend plans
    padded = torch.tensor([*pairs, *[(-1, 0)] * 11], dtype=torch.int32, device="cuda")
    count = torch.tensor([len(pairs)], dtype=torch.int32, device="cuda")
    out = torch.zeros_like(eager)
    args = (case.query, case.layer.key, case.layer.value, case.meta.block_tables, case.meta.seq_lens,
            case.meta.query_start_loc, padded)  # fmt: skip
    hopper_prefill(*args, softmax_scale=spec.scale, out=out, programs=132, tile_count=count)  # compiles
    graph = torch.cuda.CUDAGraph()
    out.zero_()
    with torch.cuda.graph(graph):
        hopper_prefill(*args, softmax_scale=spec.scale, out=out, programs=132, tile_count=count)
    graph.replay()
    torch.cuda.synchronize()
    rows = torch.cat([torch.arange(int(case.meta.query_start_loc[r]), int(case.meta.query_start_loc[r + 1]))
                      for r in {p[0] for p in pairs}])  # fmt: skip
    assert torch.equal(out[rows], eager[rows])


@pytest.mark.parametrize(("bs", "width"), [(128, 3), (32, 12)])
def test_hostile_metadata_stays_inside_the_cache_and_the_step(bs: int, width: int) -> None:
    """Block ids outside the cache, lengths past the table or negative, query starts out of
    order: no fault, and nothing written outside ``out``'s rows (guard rows around it). Blocks
    of 32: every box of a tile reads its own (hostile) id."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    host_gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, blocks, tokens = 8, 2, 128, 6 * 128 // bs, 700
    k_cache = torch.randn(blocks, bs, kv_heads, d, generator=gen, device="cuda").bfloat16()
    v_cache = torch.randn(blocks, bs, kv_heads, d, generator=gen, device="cuda").bfloat16()
    query = torch.randn(tokens, heads, d, generator=gen, device="cuda").bfloat16()
    for trial in range(8):
        rows = 4
        tables = torch.randint(-5, blocks + 5, (rows, width), generator=gen, device="cuda", dtype=torch.int32)
        seq_lens = torch.randint(-300, 3000, (rows,), generator=gen, device="cuda", dtype=torch.int32)
        starts = torch.randint(-200, tokens + 200, (rows + 1,), generator=gen, device="cuda", dtype=torch.int32)
        host_lens = [int(x) for x in torch.randint(1, 600, (rows,), generator=host_gen)]
        index = [*prefill_tile_index(host_lens, host_lens, HOPPER_PREFILL_BLOCK_M), (-1, 0)]
        tile_index = torch.tensor(index, dtype=torch.int32, device="cuda")
        # Eager (a program per item, or 5 taking turns), and on a fixed grid with the count of
        # entries read on the device (past the index, negative).
        for programs, count in ((1000, None), (5, None), (7, len(index) + 9), (7, -3), (132, 2)):
            guard = torch.full((tokens + 64, heads, d), 3.0, dtype=torch.bfloat16, device="cuda")
            out = guard[32 : 32 + tokens]
            tile_count = None if count is None else torch.tensor([count], dtype=torch.int32, device="cuda")
            hopper_prefill(
                query, k_cache, v_cache, tables, seq_lens, starts, tile_index, softmax_scale=d**-0.5, out=out,
                programs=programs, tile_count=tile_count,
            )  # fmt: skip
            torch.cuda.synchronize()
            assert bool((guard[:32] == 3.0).all()) and bool((guard[32 + tokens :] == 3.0).all()), (trial, programs)


def test_output_the_tma_store_cannot_take_gets_the_same_values() -> None:
    """An ``out`` whose heads are not packed (a padded head stride) or whose rows are not
    16-byte aligned is stored with masked stores instead of TMA: the values equal the TMA
    store's, and the padding between heads stays untouched."""
    spec = make_spec(8, 2, 128, torch.bfloat16)
    case = make_case(ROWS, spec, block_size=256, device="cuda", seed=3)
    backend = TritonBackend(spec)
    backend.write_kv(case.new_key, case.new_value, case.layer, backend.plan(case.meta))
    pairs = prefill_tile_index(case.meta.seq_lens_host, case.meta.query_lens_host, HOPPER_PREFILL_BLOCK_M)
    index = torch.tensor(pairs, dtype=torch.int32, device="cuda")
    args = (case.query, case.layer.key, case.layer.value, case.meta.block_tables, case.meta.seq_lens,
            case.meta.query_start_loc, index)  # fmt: skip
    tokens, heads, d = case.query.shape
    packed = torch.full((tokens, heads, d), 5.0, dtype=torch.bfloat16, device="cuda")
    hopper_prefill(*args, softmax_scale=spec.scale, out=packed, programs=132)
    padded = torch.full((tokens, heads, d + 8), 5.0, dtype=torch.bfloat16, device="cuda")
    hopper_prefill(*args, softmax_scale=spec.scale, out=padded[..., :d], programs=132)
    flat = torch.full((tokens * heads * d + 1,), 5.0, dtype=torch.bfloat16, device="cuda")
    unaligned = flat[1:].view(tokens, heads, d)  # rows 2 bytes off 16-byte alignment
    hopper_prefill(*args, softmax_scale=spec.scale, out=unaligned, programs=132)
    torch.cuda.synchronize()
    real = case.meta.num_real_tokens
    assert torch.isfinite(packed[:real]).all() and bool((packed[real:] == 5.0).all())
    assert rel_err(packed[:real].float(), reference_output(case)) < 1e-2
    assert torch.equal(padded[..., :d], packed) and bool((padded[..., d:] == 5.0).all())
    assert torch.equal(unaligned, packed) and float(flat[0]) == 5.0
