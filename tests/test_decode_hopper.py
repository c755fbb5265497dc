"""The Hopper decode kernel (attention/triton_kernels/decode_hopper.py) and the launch that
selects it (``DecodeConfig(hopper_wgmma=True)``).

The float64 checks run everywhere: on an sm_90 GPU with Gluon they run the Gluon kernel (and
assert it ran), elsewhere (the CPU interpreter included) the same call runs the Triton kernel,
which must then give the same answers. Caches come from tests/paged_case.py: float8_e4m3fn K
and a token-major V, or bf16 / fp16 K and V, whose unwritten slots hold NaN, shuffled block ids,
two NaN blocks around the cache; rows end inside tiles and blocks, split rows go through the
combine kernel. tests/test_decode_hopper_compile.py compiles the kernel for sm_90 without a GPU.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import attention.triton_kernels.decode as decode_module
from attention.triton_kernels import DecodeConfig, DecodeWorkspace
from attention.triton_kernels.decode_hopper import decode_hopper_shape_ok, hopper_block_n
from attention.triton_kernels.prefill_hopper import gluon_available
from attention.value_layout import token_major_view
from tests.paged_case import PagedCase
from tests.test_decode_kernel import DEVICE, _canaried, _case, _check, _prepare, _reference, _run

pytestmark = pytest.mark.kernel

ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0) and gluon_available()


@pytest.fixture
def hopper_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The Gluon kernel's launches, its loader-warp form's included (their stage counts)."""
    calls: list[int] = []
    real = decode_module.launch_decode_hopper

    def counted(*args: object, **kw: object) -> None:
        calls.append(int(args[-1]))  # type: ignore[call-overload]
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_module, "launch_decode_hopper", counted)
    return calls


def _fp8_case(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, query_dtype: torch.dtype
) -> tuple[PagedCase, PagedCase, tuple[torch.Tensor, torch.Tensor]]:
    """(fp8 case, its dequantised float32 twin, (k_scale, v_scale)): K float8_e4m3fn, V
    float8_e4m3fn token-major with NaN in every slot no token was written to."""
    case = _case(lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=torch.float32)
    key = case.layer.key.nan_to_num(0.0).to(torch.float8_e4m3fn)
    value = case.layer.value.to(torch.float8_e4m3fn)  # unwritten slots stay NaN
    v_token_major = token_major_view(torch.empty_like(value))
    v_token_major.copy_(value)
    query = case.query.to(query_dtype)
    fp8 = dataclasses.replace(case, layer=dataclasses.replace(case.layer, key=key, value=v_token_major), query=query)
    plain = dataclasses.replace(
        case, layer=dataclasses.replace(case.layer, key=key.float(), value=value.float()), query=query
    )
    gen = torch.Generator().manual_seed(len(lens))
    k_scale = (0.25 + torch.rand(kv_heads, generator=gen)).to(DEVICE)
    v_scale = (0.25 + torch.rand(kv_heads, generator=gen)).to(DEVICE)
    return fp8, plain, (k_scale, v_scale)


def _wide_case(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[PagedCase, PagedCase]:
    """(case, its float32 twin): K and V in ``dtype`` (the query's), NaN in every slot no token
    was written to."""
    case = _case(lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=torch.float32)
    key, value = case.layer.key.to(dtype), case.layer.value.to(dtype)
    wide = dataclasses.replace(
        case, layer=dataclasses.replace(case.layer, key=key, value=value), query=case.query.to(dtype)
    )
    plain = dataclasses.replace(
        case, layer=dataclasses.replace(case.layer, key=key.float(), value=value.float()), query=wide.query
    )
    return wide, plain


def _config(dtype: torch.dtype, stages: int = 2, overlap: bool | str = False) -> DecodeConfig:
    """The Hopper launch with the loop ``overlap`` names: False (in turn), True (overlapped) or
    "ws" (in turn, its loads in a warp of their own)."""
    return DecodeConfig(
        block_n=hopper_block_n(dtype), num_stages=stages, hopper_wgmma=True, hopper_overlap=overlap is True,
        hopper_ws_loader=overlap == "ws",
    )  # fmt: skip


#: The kernel's loops: each tile's steps in turn, S MMAs + softmax of a tile while the previous
#: tile's P V MMAs run, and the loop in turn with its TMA loads in a loader warp.
LOOPS = [pytest.param(False, id="in-turn"), pytest.param(True, id="overlap"), pytest.param("ws", id="ws-loader")]


def _skip_repeat_on_cpu(overlap: bool | str) -> None:
    if DEVICE == "cpu" and overlap:
        pytest.skip("the interpreter runs the Triton fallback, which has one loop: the in-turn case covers it")


CASES = [
    # heads, kv_heads, head_dim, block_size, row lengths, forced chunk_len (None: the policy)
    pytest.param(8, 2, 128, 256, [1, 127, 128, 129, 300, 513], None, id="gqa4-d128-b256-edges"),
    pytest.param(16, 2, 128, 128, [45, 700, 7, 256], 256, id="gqa8-d128-b128-split"),
    pytest.param(16, 1, 64, 256, [200, 1000, 3], 128, id="gqa16-d64-b256-split"),
    pytest.param(6, 2, 128, 256, [90, 400], 128, id="gqa3-split"),
    pytest.param(8, 2, 128, 32, [1, 33, 127, 200, 513], None, id="gqa4-d128-b32-parts"),
    pytest.param(16, 2, 64, 64, [65, 300, 129], 128, id="gqa8-d64-b64-split"),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "lens", "chunk"), CASES)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("overlap", LOOPS)
def test_matches_float64_reference(  # type: ignore[no-untyped-def]
    hopper_calls, heads, kv_heads, head_dim, block_size, lens, chunk, query_dtype, stages, overlap
) -> None:
    """Rows ending inside a tile and a block, one-token rows, split rows merged by the combine
    kernel, GQA groups of 3 to 16 heads, head_dim 64 and 128, blocks of 32 to 256 tokens (a tile
    of 1, 2 or 4 block-sized parts at shuffled block ids), per-head K and V scales: the output
    matches the float64 attention of the dequantised cache, with no NaN from the stale slots."""
    if DEVICE == "cpu" and (stages == 3 or query_dtype == torch.float16):
        pytest.skip("the interpreter runs the Triton fallback: one launch form is enough there")
    _skip_repeat_on_cpu(overlap)
    fp8, plain, scales = _fp8_case(lens, heads, kv_heads, head_dim, block_size, query_dtype)
    config = _config(torch.float8_e4m3fn, stages, overlap)
    launch = _prepare(fp8, config.block_n, **({} if chunk is None else {"chunk_len": chunk}))
    out = _run(fp8, launch, config, scales=scales)
    ranges = [(0, n) for n in fp8.meta.seq_lens_host]
    rows = list(range(len(lens)))
    ref = _reference(plain, ranges, rows, rows, 1 / math.sqrt(head_dim), scales)
    if ON_HOPPER and query_dtype == torch.float16:
        # The Gluon kernel's fp8 dots take the query and P as e4m3 hi + lo: ~8 significant
        # bits whatever the query's dtype (fp16's 11 showed errors up to 2.1e-3 against its
        # 2e-3 tolerance); the cache's own e4m3 rounding, 4 bits, is far the larger error.
        assert not out.isnan().any(), "NaN in the output: a read outside the written slots"
        torch.testing.assert_close(out.double(), ref, atol=5e-3, rtol=5e-3)
    else:
        _check(out, ref, query_dtype)
    assert hopper_calls == ([stages] if ON_HOPPER else [])


WIDE_CASES = [
    # heads, kv_heads, head_dim, block_size, row lengths, forced chunk_len (None: the policy)
    pytest.param(8, 2, 128, 256, [1, 63, 64, 65, 300, 513], None, id="gqa4-d128-b256-edges"),
    pytest.param(16, 2, 128, 32, [45, 700, 7, 256], 128, id="gqa8-d128-b32-split"),
    pytest.param(16, 1, 64, 64, [200, 1000, 3], 64, id="gqa16-d64-b64-split"),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "lens", "chunk"), WIDE_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("overlap", LOOPS)
def test_a_16bit_cache_matches_float64_reference(  # type: ignore[no-untyped-def]
    hopper_calls, heads, kv_heads, head_dim, block_size, lens, chunk, dtype, overlap
) -> None:
    """The same for a cache in the query's dtype (64-token tiles: V read transposed as the MMA's
    A operand, P as computed its B operand)."""
    if DEVICE == "cpu" and dtype == torch.float16:
        pytest.skip("the interpreter runs the Triton fallback: one launch form is enough there")
    _skip_repeat_on_cpu(overlap)
    wide, plain = _wide_case(lens, heads, kv_heads, head_dim, block_size, dtype)
    config = _config(dtype, overlap=overlap)
    launch = _prepare(wide, config.block_n, **({} if chunk is None else {"chunk_len": chunk}))
    out = _run(wide, launch, config)
    rows = list(range(len(lens)))
    ref = _reference(plain, [(0, n) for n in wide.meta.seq_lens_host], rows, rows, 1 / math.sqrt(head_dim))
    _check(out, ref, dtype)
    assert hopper_calls == ([2] if ON_HOPPER else [])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="half boxes are a form of the Gluon kernel: needs an sm_90 GPU with Gluon")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_boxes_match_float64_reference(  # type: ignore[no-untyped-def]
    hopper_calls, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """``decode_hopper.HALF_BOXES`` (off by default): one-part 16-bit tiles that end in their
    first half load half boxes, and the rows left unloaded (stale, NaN in unwritten slots) must
    not reach the output. Rows end at 1, 63-65 and 513 tokens of 64-token tiles, block 256."""
    import attention.triton_kernels.decode_hopper as hopper_module

    monkeypatch.setattr(hopper_module, "HALF_BOXES", True)
    lens = [1, 63, 64, 65, 300, 513]
    wide, plain = _wide_case(lens, 8, 2, 128, 256, dtype)
    config = _config(dtype, overlap=False)
    out = _run(wide, _prepare(wide, config.block_n), config)
    rows = list(range(len(lens)))
    ref = _reference(plain, [(0, n) for n in wide.meta.seq_lens_host], rows, rows, 1 / math.sqrt(128))
    _check(out, ref, dtype)
    assert hopper_calls == [2]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="split fp8 tiles: a form of the Gluon kernel, needs an sm_90 GPU with Gluon")
@pytest.mark.parametrize("block_size", [128, 256])
@pytest.mark.parametrize("chunk", [None, 128], ids=["whole-rows", "split-rows"])
def test_split_fp8_tiles_match_float64_reference(  # type: ignore[no-untyped-def]
    hopper_calls, monkeypatch: pytest.MonkeyPatch, block_size: int, chunk: int | None
) -> None:
    """``decode_hopper.SPLIT_FP8_TILES`` (off by default): an fp8 tile in long blocks loads as two
    parts of 64 tokens and skips the second past a chunk's end; its rows (stale, NaN in unwritten
    slots) must not reach the output. Rows end at 1, 63-65, 127-129 and 513 tokens, GQA 4."""
    import attention.triton_kernels.decode_hopper as hopper_module

    monkeypatch.setattr(hopper_module, "SPLIT_FP8_TILES", True)
    lens = [1, 63, 64, 65, 127, 128, 129, 513]
    fp8, plain, scales = _fp8_case(lens, 8, 2, 128, block_size, torch.bfloat16)
    config = _config(torch.float8_e4m3fn, stages=2)
    launch = _prepare(fp8, config.block_n, **({} if chunk is None else {"chunk_len": chunk}))
    out = _run(fp8, launch, config, scales=scales)
    rows = list(range(len(lens)))
    ref = _reference(plain, [(0, n) for n in fp8.meta.seq_lens_host], rows, rows, 1 / math.sqrt(128), scales)
    _check(out, ref, torch.bfloat16)
    assert hopper_calls == [2]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="P's hi part only: a form of the Gluon kernel, needs an sm_90 GPU with Gluon")
@pytest.mark.parametrize("block_size", [256, 32])
@pytest.mark.parametrize("overlap", LOOPS)
def test_p_hi_only_stays_near_the_float64_reference(  # type: ignore[no-untyped-def]
    hopper_calls, monkeypatch: pytest.MonkeyPatch, block_size: int, overlap: bool
) -> None:
    """``decode_hopper.FP8_P_LO`` off (on by default): P enters the P V MMAs as its e4m3 hi part
    only (3 significant bits, as FlashAttention-3's fp8 P), in one commit group a part fewer.
    The output stays within a few percent of float64 (the hi + lo form: bf16's tolerance), with
    no NaN from the stale slots; split rows merged by the combine kernel."""
    import attention.triton_kernels.decode_hopper as hopper_module

    monkeypatch.setattr(hopper_module, "FP8_P_LO", False)
    lens = [1, 127, 128, 129, 300, 513, 2000]
    fp8, plain, scales = _fp8_case(lens, 8, 2, 128, block_size, torch.bfloat16)
    config = _config(torch.float8_e4m3fn, stages=2, overlap=overlap)
    out = _run(fp8, _prepare(fp8, config.block_n, chunk_len=256), config, scales=scales)
    rows = list(range(len(lens)))
    ref = _reference(plain, [(0, n) for n in fp8.meta.seq_lens_host], rows, rows, 1 / math.sqrt(128), scales)
    assert not out.isnan().any(), "NaN in the output: a read outside the written slots"
    torch.testing.assert_close(out.double(), ref, atol=5e-2, rtol=5e-2)
    assert hopper_calls == [2]


@pytest.mark.parametrize("block_size", [256, 32])
@pytest.mark.parametrize("overlap", LOOPS)
def test_a_sliding_window_starts_inside_a_tile(hopper_calls: list[int], block_size: int, overlap: bool) -> None:
    """One-token rows under a window of 200: each row's range starts inside a tile (and, at
    block 32, inside a part), so a tile's tokens before the range are masked and zeroed too."""
    _skip_repeat_on_cpu(overlap)
    lens = [150, 333, 700, 1000]
    fp8, plain, scales = _fp8_case(lens, 8, 2, 128, block_size, torch.bfloat16)
    ranges = [(max(0, n - 200), n) for n in lens]
    launch = _prepare(fp8, 128, kv_ranges=ranges, chunk_len=128)
    out = _run(fp8, launch, _config(torch.float8_e4m3fn, overlap=overlap), scales=scales)
    rows = list(range(len(lens)))
    _check(out, _reference(plain, ranges, rows, rows, 1 / math.sqrt(128), scales), torch.bfloat16)
    assert hopper_calls == ([2] if ON_HOPPER else [])


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("block_size", [128, 32])
@pytest.mark.parametrize("overlap", LOOPS)
def test_garbage_metadata_stays_inside_every_tensor(hopper_calls: list[int], block_size: int, overlap: bool) -> None:
    """Block ids out of range (the NaN blocks around the cache, -1, 2^31 - 1; at block 32 three of
    a tile's four parts), a table row, a query token and a partial slot out of range, a kv end
    past the table: no crash, no NaN from outside the cache, and the slabs around the output and
    the partial buffers keep their bits."""
    _skip_repeat_on_cpu(overlap)
    fp8, _plain, scales = _fp8_case([300, 290, 280, 270, 260], 8, 2, 128, block_size, torch.bfloat16)
    num_blocks = fp8.layer.num_blocks
    fp8.meta.block_tables[1, :3] = torch.tensor([num_blocks, -1, 2**31 - 1], dtype=torch.int32)
    launch = _prepare(fp8, 128, chunk_len=128)
    s = launch.schedule
    out_store, out = _canaried(tuple(fp8.query.shape), torch.bfloat16, 3.0)
    po_store, part_o = _canaried(tuple(launch.workspace.part_o.shape), torch.float32, 5.0)
    pl_store, part_lse = _canaried(tuple(launch.workspace.part_lse.shape), torch.float32, 5.0)
    ws = DecodeWorkspace(part_o=part_o, part_lse=part_lse, counters=launch.workspace.counters)
    items = launch.items.clone()
    first_item = {int(items[i, 0]): i for i in reversed(range(s.num_items))}  # each row's first item
    items[first_item[0], 4] = 10**6  # table row out of range: nothing of row 0's first chunk is seen
    items[first_item[2], 5] = 10**6  # query token out of range
    items[first_item[3], 2] = 10**9  # kv end past the table: clamped, but then reads unwritten slots
    items[first_item[4], 3] = 10**6  # partial slot out of range
    bad = dataclasses.replace(launch, items=items, workspace=ws)
    before = [t.clone() for t in (out_store, po_store, pl_store)]
    _run(fp8, bad, _config(torch.float8_e4m3fn, overlap=overlap), out, scales=scales)
    assert not out[[0, 1, 2]].isnan().any()
    for store, old in zip((out_store, po_store, pl_store), before, strict=True):
        assert torch.equal(store[0], old[0]) and torch.equal(store[-1], old[-1]), "a canary slab changed"
    assert hopper_calls == ([2] if ON_HOPPER else [])


@pytest.mark.parametrize(
    ("change", "applies"),
    [
        ({}, True),
        ({"head_dim": 96}, False),
        ({"group": 17}, False),
        ({"group": 0}, False),
        ({"block_size": 64}, True),
        ({"block_size": 32}, True),
        ({"block_size": 16}, False),
        ({"block_size": 96}, False),
        ({"block_size": 384}, True),
        ({"query_len": 2}, False),
    ],
)
def test_the_shapes_it_takes(change: dict[str, int], applies: bool) -> None:
    shape = {"head_dim": 128, "group": 4, "block_size": 256, "query_len": 1, "block_n": 128, **change}
    assert decode_hopper_shape_ok(**shape) is applies


def test_the_shapes_of_64_token_tiles() -> None:
    assert decode_hopper_shape_ok(128, 4, 64, 1, 64) and decode_hopper_shape_ok(128, 4, 32, 1, 64)
    assert decode_hopper_shape_ok(128, 4, 192, 1, 64) and not decode_hopper_shape_ok(128, 4, 96, 1, 64)
    assert hopper_block_n(torch.float8_e4m3fn) == 128 and hopper_block_n(torch.bfloat16) == 64


def test_the_config_asks_for_its_tile() -> None:
    with pytest.raises(ValueError, match="block_n: 32 with hopper_wgmma"):
        DecodeConfig(block_n=32, hopper_wgmma=True)
    with pytest.raises(ValueError, match="num_stages: 1 with hopper_wgmma"):
        DecodeConfig(block_n=128, num_stages=1, hopper_wgmma=True)
    assert DecodeConfig(block_n=128, num_stages=4, hopper_wgmma=True).hopper_wgmma


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_a_launch_with_the_wrong_tile_is_refused(dtype: torch.dtype) -> None:
    """hopper_wgmma with the other cache's tile names the tile the cache needs (checked on the
    host before anything runs, whatever the device)."""
    if dtype == torch.bfloat16:
        case, _ = _wide_case([70, 200], 8, 2, 64, 64, dtype)
        scales = None
    else:
        case, _, scales = _fp8_case([70, 200], 8, 2, 64, 64, torch.bfloat16)
    wrong = 64 if dtype == torch.float8_e4m3fn else 128
    launch = _prepare(case, wrong)
    with pytest.raises(ValueError, match=f"config.block_n: {wrong} with hopper_wgmma .* pass block_n={192 - wrong}"):
        _run(case, launch, DecodeConfig(block_n=wrong, hopper_wgmma=True), scales=scales)


def test_other_launches_run_the_triton_kernel(hopper_calls: list[int]) -> None:
    """Where the kernel does not apply (here blocks of 96 tokens: a 128-token tile would have a
    part in two blocks), the same config runs the Triton kernel: the call never reaches the
    Gluon launch."""
    fp8, plain, scales = _fp8_case([70, 200], 8, 2, 64, 96, torch.bfloat16)
    launch = _prepare(fp8, 128)
    out = _run(fp8, launch, _config(torch.float8_e4m3fn), scales=scales)
    ref = _reference(plain, [(0, n) for n in fp8.meta.seq_lens_host], [0, 1], [0, 1], 1 / math.sqrt(64), scales)
    _check(out, ref, torch.bfloat16)
    assert hopper_calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the fused hi / lo MMAs: a form of the Gluon kernel, needs an sm_90 GPU")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "lens", "chunk"), CASES)
@pytest.mark.parametrize("p_lo", [True, False], ids=["p-hi-lo", "p-hi"])
@pytest.mark.parametrize("loop", [False, "ws"], ids=["in-turn", "ws-loader"])
def test_fused_hi_lo_matches_the_separate_mmas(  # type: ignore[no-untyped-def]
    hopper_calls, monkeypatch: pytest.MonkeyPatch, heads, kv_heads, head_dim, block_size, lens, chunk, p_lo, loop
) -> None:
    """``decode_hopper.FUSED_HI_LO`` (on by default): the query's (and P's) hi and lo rows as one
    MMA operand of twice the heads, the accumulator's halves added in registers. Against the
    separate MMAs (the switch off) on rows ending inside tiles and blocks, split rows, GQA groups
    of 3 to 16, head_dim 64 and 128, blocks of 32 to 256: both match the float64 reference, and
    the fused form's largest error is no larger than twice the separate form's (the same
    products; the halves are summed in fp32 instead of inside the fp8 MMA's accumulator)."""
    import attention.triton_kernels.decode_hopper as hopper_module

    monkeypatch.setattr(hopper_module, "FP8_P_LO", p_lo)
    fp8, plain, scales = _fp8_case(lens, heads, kv_heads, head_dim, block_size, torch.bfloat16)
    config = _config(torch.float8_e4m3fn, 3, loop)
    launch = _prepare(fp8, config.block_n, **({} if chunk is None else {"chunk_len": chunk}))
    rows = list(range(len(lens)))
    ref = _reference(plain, [(0, n) for n in fp8.meta.seq_lens_host], rows, rows, 1 / math.sqrt(head_dim), scales)
    outputs = {}
    for fused in (False, True):
        monkeypatch.setattr(hopper_module, "FUSED_HI_LO", fused)
        outputs[fused] = _run(fp8, launch, config, scales=scales).double()
    tolerance = 5e-3 if p_lo else 5e-2  # P's hi part alone: 3 significant bits (FP8_P_LO)
    for out in outputs.values():
        assert not out.isnan().any(), "NaN in the output: a read outside the written slots"
        torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)
    assert (outputs[True] - ref).abs().max() <= 2 * (outputs[False] - ref).abs().max()
    assert hopper_calls == [3, 3]


def test_the_loader_warp_serves_the_loop_in_turn_only() -> None:
    """``hopper_ws_loader`` needs the Hopper kernel and its loop in turn: with ``hopper_overlap``
    or without ``hopper_wgmma`` the config is refused, naming the field."""
    with pytest.raises(ValueError, match="hopper_ws_loader"):
        DecodeConfig(block_n=128, hopper_wgmma=True, hopper_overlap=True, hopper_ws_loader=True)
    with pytest.raises(ValueError, match="hopper_ws_loader"):
        DecodeConfig(block_n=128, hopper_ws_loader=True)
