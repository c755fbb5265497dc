"""What is specific to the triton backend: its tuning knobs (decode chunk lengths, decode and
prefill tile configurations, the benchmark sweeps), its plan (decode rows and schedules, the
prefill tile index, tile shrink, CUDA-graph grids), and its CPU refusals.

What every backend must do is tests/test_backend_contract.py. Without a GPU the kernels run
in Triton's CPU interpreter (tests/conftest.py), so shapes stay small; the sweeps and the
GPU-sized chunkings run on CUDA only.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from attention import ReferenceBackend
from attention.errors import InvalidArgumentError, KVCacheError, UnsupportedSettingError
from attention.spec import AttentionSpec
from attention.triton_backend import TritonBackend, TritonStepPlan
from attention.triton_kernels import (
    DECODE_SWEEP,
    PREFILL_SWEEP,
    DecodeConfig,
    DecodePolicy,
    PrefillConfig,
    default_decode_config,
    default_prefill_config,
    hopper_decode_config,
    max_decode_items,
    max_prefill_tiles,
    prefill_tile_index,
)
from tests.paged_case import (
    ODD,
    REL_TOLERANCE,
    TOLERANCE,
    PagedCase,
    make_case,
    make_spec,
    reference_output,
    rel_err,
)

pytestmark = pytest.mark.kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _attend(backend: TritonBackend, case: PagedCase) -> tuple[torch.Tensor, TritonStepPlan]:
    """The step's K/V written by the reference (the cache-write kernel is the contract suite's;
    under the interpreter it costs one program per token), then the backend's attend;
    returns (real tokens' output, plan)."""
    plan = backend.plan(case.meta)
    assert isinstance(plan, TritonStepPlan)
    writer = ReferenceBackend(case.spec)
    writer.write_kv(case.new_key, case.new_value, case.layer, writer.plan(case.meta))
    out = backend.attend(case.query, case.layer, plan)
    return out[: case.meta.num_real_tokens], plan


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "NaN in the output: a kernel read an unwritten slot"
    torch.testing.assert_close(out.double(), ref.double(), **TOLERANCE[dtype])


def _case(rows: list[tuple[int, int]], spec: AttentionSpec, block_size: int, device: str, seed: int = 0) -> PagedCase:
    return make_case(rows, spec, block_size=block_size, device=device, seed=seed)


# ---- decode: chunk lengths and tiles ---------------------------------------------------

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
def test_decode_chunk_lengths(
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
    spec = make_spec(heads, kv_heads, head_dim, dtype)
    case = _case([(c, 1) for c in contexts], spec, block_size, triton_device)
    out, plan = _attend(TritonBackend(spec, decode_chunk_len=chunk_len), case)
    assert plan.use_decode
    _check(out, reference_output(case), dtype)


@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
@pytest.mark.parametrize("block_size", [32, 64])
def test_decode_tile_sizes(block_n: int, block_size: int, triton_device: str) -> None:
    """Tiles inside one block (one table read) and tiles spanning blocks (per-token reads)."""
    spec = make_spec(4, 2, 32, torch.float32)
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=block_n), decode_chunk_len=64)
    case = _case([(c, 1) for c in (0, 63, 64, 150)], spec, block_size, triton_device)
    out, _ = _attend(backend, case)
    _check(out, reference_output(case), torch.float32)


def test_decode_chunks_of_one_tile(triton_device: str) -> None:
    """Many chunks per long row, one for short rows (the combine step skips those)."""
    spec = make_spec(2, 1, 16, torch.float16)
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16), decode_chunk_len=16)
    case = _case([(0, 1), (17, 1), (250, 1)], spec, 32, triton_device)
    out, plan = _attend(backend, case)
    assert plan.decode[0].schedule.needs_combine
    _check(out, reference_output(case), torch.float16)


def test_mixed_batch_with_forced_chunks(triton_device: str) -> None:
    """Decode rows of a mixed batch run chunked (their table rows and query tokens named in
    the items), prefill rows beside."""
    spec = make_spec(4, 2, 32, torch.bfloat16)
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16), decode_chunk_len=32)
    case = _case([(60, 1), (20, 30), (0, 1), (95, 1), (5, 17)], spec, 32, triton_device)
    out, plan = _attend(backend, case)
    assert plan.decode_rows == (0, 2, 3) and plan.prefill_rows == (1, 4)
    _check(out, reference_output(case), torch.bfloat16)


# ---- prefill: tiles ----------------------------------------------------------------------


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (16, 64), (64, 16), (32, 32)])
@pytest.mark.parametrize("block_size", [32, 64])
def test_prefill_tile_sizes(block_m: int, block_n: int, block_size: int, triton_device: str) -> None:
    """Many query tiles per row, key tiles smaller and larger than a block, diagonal tiles
    that start mid-tile (cached prefix not a multiple of the tile)."""
    spec = make_spec(4, 2, 16, torch.float32)
    backend = TritonBackend(spec, prefill_config=PrefillConfig(block_m=block_m, block_n=block_n))
    case = _case([(0, 97), (45, 40), (100, 1), (7, 33)], spec, block_size, triton_device)
    out, plan = _attend(backend, case)
    assert plan.prefill is not None and plan.prefill.config.block_m == block_m
    _check(out, reference_output(case), torch.float32)


def test_prefill_tile_index_covers_every_tile_heaviest_first() -> None:
    seq_lens, query_lens = (100, 1, 300, 64), (100, 1, 40, 64)
    tiles = prefill_tile_index(seq_lens, query_lens, 32)
    expect = {(r, t) for r, q in enumerate(query_lens) for t in range(-(-q // 32))}
    assert sorted(tiles) == sorted(expect) and len(tiles) == len(expect)
    work = [seq_lens[r] - query_lens[r] + min((t + 1) * 32, query_lens[r]) for r, t in tiles]
    assert work == sorted(work, reverse=True)


def test_prefill_tile_shrinks_to_short_rows() -> None:
    assert default_prefill_config(128, torch.bfloat16).block_m == 128
    short = default_prefill_config(128, torch.bfloat16, max_query_len=5)
    assert (short.block_m, short.num_warps) == (16, 4)
    assert default_prefill_config(128, torch.bfloat16, max_query_len=100).block_m == 128
    assert default_prefill_config(128, torch.bfloat16, max_query_len=64).block_m == 64


def test_prefill_key_tiles_stay_inside_small_blocks() -> None:
    small = default_prefill_config(128, torch.bfloat16, block_size=32)
    assert (small.block_m, small.block_n, small.num_warps) == (128, 32, 4)
    assert default_prefill_config(128, torch.bfloat16, block_size=256).block_n == 128
    assert default_prefill_config(128, torch.bfloat16, max_query_len=5, block_size=64).block_m == 16


@pytest.mark.parametrize(("cache", "block_n"), [(None, 32), ("int8", 32), ("float8_e4m3", 128)])
def test_plan_picks_small_block_tiles_except_for_fp8(cache: str | None, block_n: int) -> None:
    """At block 32 the plan takes 32-key tiles for 16-bit and int8 caches; an fp8 cache keeps
    128-key tiles (the small ones measured slower for it on the H200)."""
    spec = make_spec(4, 2, 64, torch.bfloat16, kv_cache_dtype=cache)
    case = make_case([(0, 200), (40, 1)], spec, block_size=32, device="cpu")
    plan = TritonBackend(spec).plan(case.meta)
    assert isinstance(plan, TritonStepPlan) and plan.prefill is not None
    assert plan.prefill.config.block_n == block_n


# ---- the plan ----------------------------------------------------------------------------


def test_plan_sends_rows_to_their_kernels(triton_device: str) -> None:
    """Rows of up to max_decode_query_len new tokens go to the decode kernel, at their query
    tokens; the rest to prefill, in a tile index of the step's tile height, heaviest first."""
    spec = make_spec(2, 1, 16, torch.float32)
    case = _case([(10, 5), (3, 1), (0, 12), (7, 1)], spec, 32, triton_device)
    plan = TritonBackend(spec).plan(case.meta)
    assert isinstance(plan, TritonStepPlan) and not plan.use_decode
    assert plan.decode_rows == (0, 1, 3) and plan.prefill_rows == (2,)
    (launch,) = plan.decode
    assert launch.schedule.query_len == 8
    # Decode row d reads table row decode_rows[d] and owns its query tokens.
    assert [launch.schedule.row(d)[:2] for d in range(3)] == [(0, 0), (1, 5), (3, 18)]
    assert [launch.schedule.row(d)[4] for d in range(3)] == [5, 1, 1]
    assert plan.prefill is not None
    config = plan.prefill.config
    assert config == default_prefill_config(16, torch.float32, 12) and config.block_m == 16
    expect = prefill_tile_index((15, 4, 12, 8), (5, 1, 12, 1), config.block_m, rows=(2,))
    assert plan.prefill.tile_index.tolist() == [list(p) for p in expect] == [[2, 0]]
    # With max_decode_query_len 1 only one-token rows go to the decode kernel.
    one = TritonBackend(spec, max_decode_query_len=1).plan(case.meta)
    assert isinstance(one, TritonStepPlan) and one.decode_rows == (1, 3) and one.prefill_rows == (0, 2)
    assert one.decode[0].schedule.query_len == 1
    for bad in (0, 3, 16):
        with pytest.raises(UnsupportedSettingError, match="max_decode_query_len"):
            TritonBackend(spec, max_decode_query_len=bad)
    pure = TritonBackend(spec).plan(_case([(5, 1)], spec, 32, triton_device).meta)
    assert isinstance(pure, TritonStepPlan) and pure.use_decode and pure.prefill is None
    assert pure.decode[0].schedule.row(0)[:2] == (0, 0)


def test_a_launchs_wave_fill_reaches_the_schedule(triton_device: str) -> None:
    """``DecodeConfig.wave_fill`` becomes the policy's when no policy is given (a given
    policy keeps its own), and the step's equal rows are then cut to fill the waves; out of
    range it is refused."""
    spec = make_spec(8, 2, 64, torch.float16)
    config = DecodeConfig(block_n=16, wave_fill=0.9)
    assert TritonBackend(spec, decode_config=config)._decode_launch(1, 32)[1].wave_fill == 0.9
    given = TritonBackend(spec, decode_config=config, decode_policy=DecodePolicy())
    assert given._decode_launch(1, 32)[1].wave_fill == 0.0
    # 10 rows x 2 KV heads on 12 SMs, one program an SM: 20 programs for 12 places (83% of 2
    # waves); in 2 pieces 40 (83% of 4), in 3 pieces 60 (100% of 5).
    case = make_case([(900, 1)] * 10, spec, block_size=32, device=triton_device)
    plain = TritonBackend(spec, decode_config=DecodeConfig(block_n=16, programs_per_sm=1), num_sms=12)
    filled = TritonBackend(spec, decode_config=DecodeConfig(block_n=16, programs_per_sm=1, wave_fill=0.9), num_sms=12)
    assert plain.decode_policy == filled.decode_policy == DecodePolicy()
    (whole,) = plain.plan(case.meta).decode  # type: ignore[attr-defined]
    (cut,) = filled.plan(case.meta).decode  # type: ignore[attr-defined]
    assert whole.schedule.num_items == 10 and cut.schedule.num_items == 30
    out, _ = _attend(filled, case)
    _check(out, reference_output(case), torch.float16)
    for bad in (-0.5, 2.0):
        with pytest.raises(ValueError, match=r"DecodeConfig\.wave_fill"):
            DecodeConfig(wave_fill=bad)


def test_one_token_launches_keep_rows_within_a_slots_share_whole(triton_device: str) -> None:
    """The default one-token launches carry a slot share into the policy (1.0 for an fp8
    cache, 0.75 for a 16-bit one; verify launches none; a given policy keeps its own): rows
    no longer than a place's share of the step stay whole where balance alone would split the
    long ones, and the output is unchanged."""
    fp8 = make_spec(8, 2, 64, torch.float16, kv_cache_dtype="float8_e4m3")
    f16 = make_spec(8, 2, 64, torch.float16)
    assert TritonBackend(fp8)._decode_launch(1, 32)[1].slot_share == 1.0
    assert TritonBackend(fp8)._decode_launch(1, 256)[1].slot_share == 1.0
    assert TritonBackend(f16)._decode_launch(1, 32)[1].slot_share == 0.75
    assert TritonBackend(f16)._decode_launch(4, 32)[1].slot_share == 0.0
    assert TritonBackend(f16, decode_policy=DecodePolicy())._decode_launch(1, 32)[1].slot_share == 0.0
    # 24 rows x 2 KV heads on 2 SMs (6 places): a place's share is 6,850 tokens x 2 KV heads
    # / 6 places, ~2,280 tokens; the rows of 700 and 650 are over 1.25 x the mean (~285).
    lens = [700, 650] + [250] * 22
    case = make_case([(n, 1) for n in lens], f16, block_size=32, device=triton_device)
    shared = TritonBackend(f16, num_sms=2)
    plain = TritonBackend(f16, num_sms=2, decode_policy=DecodePolicy())
    (whole,) = shared.plan(case.meta).decode  # type: ignore[attr-defined]
    (split,) = plain.plan(case.meta).decode  # type: ignore[attr-defined]
    assert whole.schedule.num_items == len(lens) < split.schedule.num_items
    out, _ = _attend(shared, case)
    _check(out, reference_output(case), torch.float16)
    with pytest.raises(ValueError, match=r"DecodeConfig\.slot_share"):
        DecodeConfig(slot_share=-1.0)


def test_a_register_cap_reaches_the_launch(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DecodeConfig.maxnreg`` is passed to the chunk kernel's launch (a compile option: the
    output is the same); outside [32, 255] or not an int it is refused."""
    from attention.triton_kernels import decode as decode_module

    kernel = decode_module.decode_items_kernel
    options: list[object] = []

    class Recording:
        def __getitem__(self, grid: object) -> Any:
            def launch(*args: object, **kwargs: object) -> object:
                options.append(kwargs.get("maxnreg"))
                return kernel[grid](*args, **kwargs)

            return launch

    spec = make_spec(8, 2, 64, torch.float16)
    case = make_case([(300, 1), (77, 1)], spec, block_size=32, device=triton_device)
    monkeypatch.setattr(decode_module, "decode_items_kernel", Recording())
    for cap in (128, None):
        backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16, maxnreg=cap))
        out, _ = _attend(backend, case)
        _check(out, reference_output(case), torch.float16)
        assert options[-1] == cap
    for bad in (31, 256, 128.0, True):
        with pytest.raises(ValueError, match=r"DecodeConfig\.maxnreg"):
            DecodeConfig(maxnreg=bad)  # type: ignore[arg-type]


def test_fixed_buffers_hold_a_wave_filled_graph_step(triton_device: str) -> None:
    """An fp8 cache at block 32 cuts near-equal rows to fill the waves (its default launch's
    ``wave_fill``), which takes more items and partial slots than the default policy's
    bounds: the builder's fixed buffers are sized for it, so a CUDA-graph bucket of such rows
    plans (8 rows x 2 KV heads on 4 SMs: 16 programs for 12 places, cut in three). The
    Triton kernel's launch, named (``hopper_decode=False``; by default an fp8 cache at block 32
    on an sm_90 GPU takes the Gluon kernel's, which fills no waves)."""
    from kvcache import BlockManager, MetadataBuilder, ScheduledRow, StepCapacity

    spec = make_spec(8, 2, 64, torch.float16, kv_cache_dtype="float8_e4m3")
    backend = TritonBackend(spec, num_sms=4, hopper_decode=False)
    manager = BlockManager(8 * 32 + 4, 32)
    for i in range(8):
        manager.allocate(i, 1000)
    MetadataBuilder(triton_device).build(manager, [ScheduledRow(i, 999, start=0) for i in range(8)])  # the prompts
    builder = MetadataBuilder(triton_device, capacity=StepCapacity(8, 8, 32), backend=backend)
    plan = builder.plan(manager, [ScheduledRow(i, 1, start=999) for i in range(8)], pad_to=8)
    (launch,) = plan.decode  # type: ignore[attr-defined]
    assert launch.config.wave_fill == 0.9 and launch.schedule.num_items == 24, launch.schedule
    bound = backend._bounding_decode_policy()
    assert bound.wave_fill == 0.9 and bound.programs_per_sm == backend.decode_policy.programs_per_sm
    assert TritonBackend(make_spec(8, 2, 64, torch.float16))._bounding_decode_policy().wave_fill == 0.0


@pytest.mark.parametrize("cache", ["float8_e4m3", None])
def test_fp8_decode_launches_pipeline_deeper(cache: str | None, triton_device: str) -> None:
    """The default one-token launch of an fp8 cache takes 3 stages where its tiles span
    blocks, and 4 stages scheduled for 2 programs an SM where a tile lies inside one block
    (``default_decode_config``): fewer chunks then, never more items or partial slots than
    the buffers hold; a bf16 cache, rows verifying drafts, a given config and a given policy
    keep theirs. The Triton kernel's launches, named (``hopper_decode=False``; by default an
    sm_90 GPU takes the Gluon kernel's)."""
    spec = make_spec(8, 2, 128, torch.bfloat16, kv_cache_dtype=cache)
    kv = torch.float8_e4m3fn if cache else None
    tile = default_decode_config(128, torch.bfloat16, kv).block_n
    rows = [(8000, 1), (6000, 1)]
    for block_size in (32, 2 * tile):
        inside = cache is not None and block_size % tile == 0
        case = make_case(rows, spec, block_size=block_size, device=triton_device, pad_to=4)
        backend = TritonBackend(spec, num_sms=16, hopper_decode=False)
        (launch,) = backend.plan(case.meta).decode  # type: ignore[attr-defined]
        assert launch.config.block_n == tile
        assert launch.config.num_stages == (4 if inside else 3 if cache else 2), (block_size, launch.config)
        assert launch.config.programs_per_sm == (2 if inside else None)
        assert launch.config.wave_fill == (0.9 if cache and not inside else None)
        policy = DecodePolicy(programs_per_sm=3)
        kept_backend = TritonBackend(spec, num_sms=16, decode_policy=policy, hopper_decode=False)
        (kept,) = kept_backend.plan(case.meta).decode  # type: ignore[attr-defined]
        # 2 rows on 2 KV heads, 16 SMs: 3 programs an SM want <= 24 items, 2 want <= 16.
        assert kept.schedule.num_items > 16 and kept.schedule.num_items <= 24, kept.schedule
        assert launch.schedule.num_items <= (16 if inside else 24) and launch.schedule.num_items > 12
        graph = backend.plan(case.meta, graph=True)
        (captured,) = graph.decode  # type: ignore[attr-defined]
        bound = max_decode_items(4, 2, 16, backend.decode_policy)
        assert captured.schedule.grid_items <= bound and captured.items.shape[0] <= bound
        given = DecodeConfig(block_n=tile, num_warps=4, num_stages=2)
        (fixed,) = TritonBackend(spec, decode_config=given).plan(case.meta).decode  # type: ignore[attr-defined]
        assert fixed.config == given
    drafts = _case([(300, 4)], spec, 2 * tile, triton_device)
    (verify,) = TritonBackend(spec).plan(drafts.meta).decode  # type: ignore[attr-defined]
    assert verify.config.num_stages == 2 and verify.config.programs_per_sm is None


ON = {"hopper_decode": True}
AUTO = {"hopper_decode": None}
HOPPER_CHOICES = [
    # spec keywords, block size, backend keywords, whether the Hopper launch is chosen
    pytest.param({}, 32, ON, True, id="bf16-b32"),
    pytest.param({"kv_cache_dtype": "float8_e4m3"}, 256, ON, True, id="fp8-b256"),
    pytest.param({"kv_cache_dtype": "float8_e4m3"}, 32, ON, True, id="fp8-b32"),
    pytest.param({"sliding_window": 100}, 64, ON, True, id="window"),
    pytest.param({}, 96, ON, False, id="block-96"),
    pytest.param({"kv_cache_dtype": "int8"}, 32, ON, False, id="int8"),
    pytest.param({"logit_softcap": 30.0}, 32, ON, False, id="softcap"),
    pytest.param({"attention_sinks": True}, 32, ON, False, id="sinks"),
    pytest.param({}, 32, {}, True, id="default-bf16"),
    pytest.param({"kv_cache_dtype": "float8_e4m3"}, 32, {}, True, id="default-fp8-b32"),
    pytest.param({"kv_cache_dtype": "float8_e4m3"}, 256, {}, True, id="default-fp8-b256"),
    pytest.param({"kv_cache_dtype": "float8_e4m3"}, 32, {"hopper_decode": False}, False, id="off-fp8-b32"),
    pytest.param({}, 256, {"hopper_decode": False}, False, id="off-bf16-b256"),
    pytest.param({}, 32, AUTO, True, id="auto-bf16"),
    pytest.param({"dtype": torch.float16}, 64, AUTO, True, id="auto-fp16"),
    pytest.param({"kv_cache_dtype": "float8_e4m3"}, 64, AUTO, True, id="auto-fp8-b64"),
    pytest.param({"kv_cache_dtype": "float8_e4m3"}, 256, AUTO, True, id="auto-fp8-b256"),
    pytest.param({}, 256, AUTO, True, id="auto-bf16-b256"),
    pytest.param({"kv_cache_dtype": "float8_e4m3", "dtype": torch.float16}, 32, AUTO, False, id="auto-fp8-fp16"),
    pytest.param({"kv_cache_dtype": "float8_e4m3", "dtype": torch.float16}, 32, ON, True, id="on-fp8-fp16"),
    pytest.param({"kv_cache_dtype": "int8"}, 32, AUTO, False, id="auto-int8"),
    pytest.param({}, 96, AUTO, False, id="auto-block-96"),
    pytest.param({}, 32, {**ON, "decode_config": DecodeConfig(block_n=64)}, False, id="given-config"),
]


@pytest.mark.parametrize(("spec_kw", "block_size", "backend_kw", "hopper"), HOPPER_CHOICES)
def test_sm90_one_token_rows_take_the_hopper_launch(
    spec_kw: dict[str, Any],
    block_size: int,
    backend_kw: dict[str, Any],
    hopper: bool,
    triton_device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``hopper_decode`` on, where the device could run the Hopper decode kernel (here
    made to say so), one-token rows over a bf16 or fp8 cache of blocks it takes get
    ``hopper_decode_config``'s launch (its tile, 3 stages, 2 programs an SM, within the
    default policy's bound); an int8 cache, a cap, sinks, a block of 96, ``hopper_decode=False``
    and a given config keep the Triton launch, and rows verifying drafts the verify launch.
    With ``hopper_decode=None`` (the default) the same, but an fp8 cache only under bf16
    queries. The output is right (elsewhere than on an sm_90 GPU the Triton kernel
    runs the Hopper tiles)."""
    import attention.triton_backend as backend_module

    monkeypatch.setattr(backend_module, "hopper_prefill_possible", lambda device: True)
    spec_kw = dict(spec_kw)
    dtype = spec_kw.pop("dtype", torch.bfloat16)
    spec = make_spec(8, 2, 64, dtype, **spec_kw)
    backend = TritonBackend(spec, num_sms=8, **backend_kw)
    case = _case([(300, 1), (77, 1), (1, 1)], spec, block_size, triton_device)
    (launch,) = [d for d in backend.plan(case.meta).decode if d.window == spec.sliding_window]  # type: ignore[attr-defined]
    kv = backend.cache_dtype if spec.quantized_cache else None
    if hopper:
        assert launch.config == hopper_decode_config(backend.cache_dtype)
        assert launch.config.hopper_wgmma and launch.config.num_stages == 3 and launch.config.programs_per_sm == 2
        assert launch.config.block_n == (128 if spec.quantized_cache else 64)
    elif "decode_config" in backend_kw:
        assert launch.config == backend_kw["decode_config"]
    else:
        assert launch.config == default_decode_config(64, dtype, kv, block_size=block_size)
    assert launch.schedule.num_items <= max_decode_items(3, 2, 8, backend._bounding_decode_policy())
    if spec_kw or block_size != 32 or not hopper:
        return  # one output check is enough under the interpreter; the GPU suite checks the kernel
    out, _ = _attend(backend, case)
    assert rel_err(out, reference_output(case)) < REL_TOLERANCE[torch.bfloat16]
    drafts = _case([(300, 4)], spec, block_size, triton_device)
    (verify,) = backend.plan(drafts.meta).decode  # type: ignore[attr-defined]
    assert verify.config == backend.verify_decode_config and not verify.config.hopper_wgmma


def test_graph_plans_depend_only_on_the_bucket(triton_device: str) -> None:
    """Two decode steps padded to one CUDA-graph bucket, with other rows and very different
    lengths (so other chunkings): every launch parameter a graph captures -- grid sizes, the
    staged arrays' shapes, the workspace -- is the same; the outputs are right. (Planned for
    an 8-SM GPU, so the interpreter's grids stay small.)"""
    spec = make_spec(4, 2, 32, torch.float16, sliding_window=40, window_layers=(False, True))
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16), num_sms=8)
    steps = [[(3, 1), (90, 1), (40, 1)], [(300, 1), (0, 1), (31, 1), (32, 1), (150, 1), (5, 1), (64, 1)]]
    plans = []
    for i, rows in enumerate(steps):
        case = make_case(rows, spec, block_size=32, device=triton_device, pad_to=8, seed=i)
        plan = backend.plan(case.meta, graph=True)
        assert isinstance(plan, TritonStepPlan) and [d.window for d in plan.decode] == [None, 40]
        backend.write_kv(case.new_key, case.new_value, case.layer, plan)
        out = backend.attend(case.query, case.layer, plan)  # layer 0: full attention
        _check(out[: len(rows)], reference_output(case), torch.float16)
        plans.append(plan)
    first, second = plans
    assert first.decode[0].schedule.chunk_len != second.decode[0].schedule.chunk_len, "the steps should differ"
    for a, b in zip(first.decode, second.decode, strict=True):
        assert (a.schedule.grid_items, a.schedule.grid_rows) == (b.schedule.grid_items, b.schedule.grid_rows)
        assert a.items.shape == b.items.shape and a.rows.shape == b.rows.shape
    assert first.workspace is not None and second.workspace is not None
    for name in ("part_o", "part_lse", "counters"):
        assert getattr(first.workspace, name).shape == getattr(second.workspace, name).shape, name


def test_direct_decode_graphs_name_the_variant_a_step_needs(
    triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``direct_decode_graphs``: a graph step none of whose rows splits names the "direct"
    variant and launches no combine kernel; one with a split row names "combine" and refuses
    to become "direct"; either plan can become "combine" (capture). Outputs equal the default
    backend's bit for bit. Without the flag a plan has the one variant None."""
    from attention.triton_kernels import decode as decode_module

    spec = make_spec(8, 2, 64, torch.float16)
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16), num_sms=2)
    plain = TritonBackend(spec, decode_config=DecodeConfig(block_n=16), num_sms=2, direct_decode_graphs=False)
    fused = TritonBackend(spec, decode_config=DecodeConfig(block_n=16, fused_combine=True), num_sms=2)
    assert backend.graph_variants() == ("combine", "direct") and plain.graph_variants() == (None,)
    assert fused.graph_variants() == (None,) and TritonBackend(spec).graph_variants() == ("combine", "direct")
    combines: list[object] = []
    kernel = decode_module.decode_combine_kernel

    class Recording:
        def __getitem__(self, grid: object) -> Any:
            combines.append(grid)
            return kernel[grid]

    monkeypatch.setattr(decode_module, "decode_combine_kernel", Recording())
    whole = make_case([(40, 1), (37, 1), (45, 1)], spec, block_size=32, device=triton_device, pad_to=4, seed=1)
    split = make_case([(40, 1), (900, 1), (45, 1)], spec, block_size=32, device=triton_device, pad_to=4, seed=2)
    for case, variant in ((whole, "direct"), (split, "combine")):
        plan = backend.plan(case.meta, graph=True)
        assert isinstance(plan, TritonStepPlan) and plan.graph_variant == variant
        assert plain.plan(case.meta, graph=True).graph_variant is None
        assert fused.plan(case.meta, graph=True).graph_variant is None
        backend.write_kv(case.new_key, case.new_value, case.layer, plan)
        del combines[:]
        out = backend.attend(case.query, case.layer, plan)
        assert len(combines) == (variant == "combine")
        expected = plain.attend(case.query, case.layer, plain.plan(case.meta, graph=True))[:3]
        assert torch.equal(out[:3], expected)  # the real tokens (padding rows' are unwritten)
        _check(out[:3], reference_output(case), torch.float16)
        both = plan.as_graph_variant("combine")
        assert both.graph_variant == "combine" and all(launch.combine for launch in both.decode)
        del combines[:]
        assert torch.equal(backend.attend(case.query, case.layer, both)[:3], expected)
        assert len(combines) == 1  # the fixed grid's combine runs, whatever it merges
    with pytest.raises(InvalidArgumentError, match="rows of this step split"):
        backend.plan(split.meta, graph=True).as_graph_variant("direct")
    for bad in (None, "fused"):
        with pytest.raises(InvalidArgumentError, match="variant"):
            backend.plan(whole.meta, graph=True).as_graph_variant(bad)
    with pytest.raises(InvalidArgumentError, match="one graph variant None"):
        plain.plan(whole.meta, graph=True).as_graph_variant("direct")
    assert backend.plan(whole.meta).graph_variant is None  # an eager plan: no variants


@pytest.mark.parametrize("layer_index", [0, 1], ids=["full", "window"])
def test_mixed_graph_plans_depend_only_on_the_bucket(layer_index: int, triton_device: str) -> None:
    """Steps with prefill rows beside decode rows (and one with none), padded to one bucket
    of 6 rows and 96 tokens: every launch a graph captures -- the decode grid, the prefill
    tile index's length, its tile height and its persistent program count -- is the same; the
    outputs are right for a full and a windowed layer, and padding tokens are never written."""
    spec = make_spec(4, 2, 32, torch.float16, sliding_window=40, window_layers=(False, True))
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16), num_sms=8)
    steps = [
        [(3, 1), (0, 37), (90, 1)],
        [(70, 20), (31, 1), (0, 5), (150, 1), (12, 33)],
        [(64, 1), (5, 1)],  # no prefill rows: the fixed prefill launch runs no tile
    ]
    plans = []
    for i, rows in enumerate(steps):
        case = make_case(
            rows, spec, block_size=32, device=triton_device, pad_to=6, pad_tokens=96, seed=i, layer_index=layer_index
        )
        assert case.meta.num_tokens == 96 and case.meta.padded_batch == 6
        plan = backend.plan(case.meta, graph=True)
        assert isinstance(plan, TritonStepPlan) and plan.prefill is not None
        # A bucket with room for several tokens per row compiles its decode launch for 8, so
        # rows of up to 8 new tokens (the 5-token row here) replay on the decode kernel.
        assert all(d.schedule.query_len == 8 for d in plan.decode)
        assert plan.decode_rows == tuple(r for r, (_, q) in enumerate(rows) if q <= 8)
        backend.write_kv(case.new_key, case.new_value, case.layer, plan)
        out = backend.attend(case.query, case.layer, plan)
        _check(out[: case.meta.num_real_tokens], reference_output(case), torch.float16)
        assert plan.prefill.tile_count is not None
        assert plan.prefill.tile_count.tolist() == [len(prefill_tile_index(
            case.meta.seq_lens_host, case.meta.query_lens_host, plan.prefill.config.block_m, plan.prefill_rows
        ))]  # fmt: skip
        plans.append(plan)
    first = plans[0]
    assert first.prefill is not None
    assert first.prefill.config == default_prefill_config(32, torch.float16, block_size=32)
    for other in plans[1:]:
        assert other.prefill is not None
        assert other.prefill.config == first.prefill.config
        assert other.prefill.tile_index.shape == first.prefill.tile_index.shape
        assert other.prefill.programs == first.prefill.programs == 16
        for a, b in zip(first.decode, other.decode, strict=True):
            assert (a.schedule.grid_items, a.schedule.grid_rows) == (b.schedule.grid_items, b.schedule.grid_rows)


def test_prefill_rows_need_a_bucket_with_room_for_them(triton_device: str) -> None:
    """A graph plan whose bucket has as many tokens as rows (a decode bucket) refuses a
    prefill row, naming the fix."""
    spec = make_spec(2, 1, 16, torch.float32)
    case = make_case([(3, 2)], spec, block_size=32, device=triton_device, pad_to=3, pad_tokens=3)
    with pytest.raises(KVCacheError, match="pad_tokens"):
        TritonBackend(spec).plan(case.meta, graph=True)


def test_prefill_tile_bound_covers_every_step_of_a_bucket() -> None:
    """max_prefill_tiles bounds the tile index of any step of at most ``rows`` rows and
    ``tokens`` tokens (random splits, and the worst: many rows one token past a tile)."""
    gen = random.Random(0)
    for rows, tokens, block_m in [(4, 64, 16), (128, 256, 128), (3, 7, 16), (1, 2, 16), (8, 1000, 64)]:
        splits = [[block_m + 1] * min(rows, tokens // (block_m + 1))]
        for _ in range(200):
            q_lens: list[int] = []
            while len(q_lens) < rows and tokens - sum(q_lens) >= 2 and gen.random() < 0.8:
                q_lens.append(gen.randint(2, min(tokens - sum(q_lens), 2 * block_m)))
            splits.append(q_lens)
        for q_lens in filter(None, splits):
            found = prefill_tile_index(q_lens, q_lens, block_m)
            assert len(found) <= max_prefill_tiles(rows, tokens, block_m), (rows, tokens, q_lens)


@pytest.mark.parametrize("graph", [False, True], ids=["per-tile", "fixed-grid"])
def test_windowed_extend_reads_nothing_behind_the_window(graph: bool, triton_device: str) -> None:
    """An extend row of 37 new tokens over 347 cached, window 32, blocks wholly behind the
    window released: their table entries point at a never-written (NaN) block, as a reused
    block's bits would be anything. The prefill kernel must not fold keys that no query of a
    tile sees into its sums (a masked key times a NaN value is NaN): the output is finite and
    matches the float64 reference."""
    spec = make_spec(4, 1, 32, torch.float16, sliding_window=32)
    case = make_case([(347, 37), (40, 1)], spec, block_size=32, device=triton_device, pad_to=2 if graph else None,
                     pad_tokens=64 if graph else None)  # fmt: skip
    tables = case.meta.block_tables
    owned = {int(b) for b in tables[0, :12].tolist()} | {int(b) for b in tables[1, :2].tolist()}
    nan_block = next(b for b in range(case.layer.key.shape[0]) if b not in owned)
    assert case.layer.key[nan_block].isnan().all()
    first_visible = (347 - 32 + 1) // 32  # column 9 holds position 316, the first query's oldest key
    tables[0, :first_visible] = nan_block
    backend = TritonBackend(spec)
    plan = backend.plan(case.meta, graph=graph)
    assert isinstance(plan, TritonStepPlan) and plan.prefill is not None
    writer = ReferenceBackend(case.spec)
    writer.write_kv(case.new_key, case.new_value, case.layer, writer.plan(case.meta))
    out = backend.attend(case.query, case.layer, plan)[: case.meta.num_real_tokens]
    _check(out, reference_output(case), torch.float16)


def test_layers_reuse_the_plan_without_launch_checks(monkeypatch: pytest.MonkeyPatch, triton_device: str) -> None:
    """The plan made the decode schedule from the metadata and the spec, so per-layer calls
    skip the launcher's host checks (no per-layer Python cost) and every layer is right."""
    from attention.triton_kernels import decode as decode_module

    calls = []
    real = decode_module.check_decode_launch
    monkeypatch.setattr(decode_module, "check_decode_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = make_spec(4, 2, 16, torch.float32)
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16), decode_chunk_len=16)
    case = _case([(39, 1), (2, 1)], spec, 32, triton_device)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    for _ in range(2):
        _check(backend.attend(case.query, case.layer, plan), reference_output(case), torch.float32)
    assert not calls


def test_cache_write_skips_slots_outside_the_cache(triton_device: str) -> None:
    """The kernel stays inside the cache whatever the device metadata says (the reference
    refuses such a slot instead: tests/test_reference_backend.py)."""
    spec = make_spec(2, 1, 16, torch.float32)
    case = _case([(3, 2)], spec, 32, triton_device)
    backend = TritonBackend(spec)
    plan = backend.plan(case.meta)
    num_slots = case.layer.num_slots
    case.meta.slot_mapping.copy_(torch.tensor([num_slots, -5]))  # one past the last slot; below 0
    before = case.storage.clone()
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    assert torch.equal(case.storage.view(torch.int32), before.view(torch.int32))


# ---- refusals ----------------------------------------------------------------------------


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every kernel launch fail, to prove the checks fire first."""

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was launched before the arguments were rejected")

    for name in ("paged_decode", "paged_prefill", "write_kv_cache"):
        monkeypatch.setattr(f"attention.triton_backend.{name}", launched)


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("change", ["query_dtype", "query_heads", "cache_block_48", "cache_not_contiguous"])
def test_attend_checks_before_any_kernel(change: str, triton_device: str) -> None:
    spec = make_spec(4, 2, 16, torch.float16)
    case = _case([(5, 1), (3, 4)], spec, 32, triton_device)
    backend = TritonBackend(spec)
    plan = backend.plan(case.meta)
    query, layer = case.query, case.layer
    if change == "query_dtype":
        query = query.float()
    elif change == "query_heads":
        query = query[:, :2]
    elif change == "cache_block_48":
        blocks = torch.zeros(4, 48, 2, 16, dtype=torch.float16, device=triton_device)
        layer = dataclasses.replace(layer, key=blocks, value=blocks.clone())
    else:
        layer = dataclasses.replace(layer, key=layer.key.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(KVCacheError):
        backend.attend(query, layer, plan)


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hopper_prefill": "no"}, "hopper_prefill"),
        ({"hopper_decode": 1}, "hopper_decode"),
        ({"hopper_decode": "auto"}, "hopper_decode"),
        ({"hopper_decode_overlap": "yes"}, "hopper_decode_overlap"),
        ({"hopper_decode_ws_loader": 1}, "hopper_decode_ws_loader"),
        ({"hopper_mla_decode": 0}, "hopper_mla_decode"),
        ({"hopper_mla_ring": None}, "hopper_mla_ring"),
        ({"hopper_mla_split": 1}, "hopper_mla_split"),
        ({"hopper_mla_fused_merge": "on"}, "hopper_mla_fused_merge"),
        ({"direct_decode_graphs": "yes"}, "direct_decode_graphs"),
        ({"num_sms": 0}, "num_sms"),
        ({"num_sms": 13.5}, "num_sms"),
        ({"num_sms": True}, "num_sms"),
    ],
)
def test_bad_constructor_arguments_are_refused_by_name(kwargs: dict[str, object], field: str) -> None:
    """A flag that is not a bool (a string "no" would be truthy) or an SM count below 1 is
    refused when the backend is made, naming the argument, not when a step is planned."""
    with pytest.raises(UnsupportedSettingError, match=field):
        TritonBackend(AttentionSpec(4, 2, 32, "float32"), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_warps": 3}, "num_warps"),
        ({"num_warps": 4.0}, "num_warps"),
        ({"combine_num_warps": 32}, "combine_num_warps"),
        ({"combine_num_warps": 0}, "combine_num_warps"),
        ({"slot_share": 4.5}, "slot_share"),
    ],
)
def test_bad_decode_launch_values_are_refused_by_name(kwargs: dict[str, object], field: str) -> None:
    """Warp counts Triton cannot launch and a slot share out of range are refused when the
    launch is made (not at its first kernel call), naming the field."""
    with pytest.raises(ValueError, match=rf"DecodeConfig\.{field}"):
        DecodeConfig(**kwargs)  # type: ignore[arg-type]


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = make_spec(4, 2, 16, torch.float16)
    backend = TritonBackend(spec)
    with pytest.raises(UnsupportedSettingError, match=r"needs CUDA tensors; set TRITON_INTERPRET=1"):
        backend._device_type_for_checks("cpu")
    case = _case([(5, 1)], spec, 32, "cpu")
    with pytest.raises(UnsupportedSettingError, match="needs CUDA tensors"):
        backend.write_kv(case.new_key, case.new_value, case.layer, backend.plan(case.meta))


@pytest.mark.usefixtures("no_kernels")
def test_interpreter_requested_after_import_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("attention.triton_backend.kernels_interpreted", lambda: False)
    with pytest.raises(UnsupportedSettingError, match=r"before importing attention\.triton_backend"):
        TritonBackend(make_spec(4, 2, 16, torch.float16))._device_type_for_checks("cpu")


# ---- GPU: chunkings at GPU sizes, the benchmark sweeps -----------------------------------

GPU_DECODE = [(c, 1) for c in (0, 1, 31, 255, 256, 257, 1000, 2047, 4095, 8191)]
GPU_MIXED = [(0, 1), (0, 31), (0, 97), (255, 1), (256, 1), (257, 1), (600, 33), (1000, 1), (0, 513), (31, 300)]
# (dtype, GQA group, head_dim): each combination is a separate compiled kernel, so the grid
# covers every value of each axis without the full product (compile time dominates).
GPU_SHAPES = [
    pytest.param(torch.bfloat16, 1, 128, id="bf16-g1-d128"),
    pytest.param(torch.bfloat16, 4, 128, id="bf16-g4-d128"),
    pytest.param(torch.bfloat16, 8, 128, id="bf16-g8-d128"),
    pytest.param(torch.float16, 4, 64, id="fp16-g4-d64"),
    pytest.param(torch.bfloat16, 4, 256, id="bf16-g4-d256"),
    pytest.param(torch.float16, 8, 256, id="fp16-g8-d256"),
]


def _gpu_check(backend: TritonBackend, case: PagedCase) -> None:
    out, _ = _attend(backend, case)
    dtype = getattr(torch, case.spec.dtype)
    assert rel_err(out, reference_output(case)) < REL_TOLERANCE[dtype]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("dtype", "group", "head_dim"), GPU_SHAPES)
@pytest.mark.parametrize("block_size", [32, 256])
@pytest.mark.parametrize("chunk_len", [None, 10**6, 256, 64])
def test_gpu_decode_chunk_lengths(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, chunk_len: int | None
) -> None:
    spec = make_spec(2 * group, 2, head_dim, dtype)
    case = _case(GPU_DECODE, spec, block_size, "cuda", seed=group * 1000 + head_dim)
    _gpu_check(TritonBackend(spec, decode_chunk_len=chunk_len), case)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache", [None, "float8_e4m3"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block_size", [32, 256])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-plan"])
def test_gpu_decode_runs_the_hopper_kernel_on_sm90(
    cache: str | None, block_size: int, graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hopper_decode=True`` on an sm_90 GPU with Gluon: one-token rows of a bf16 or fp8 cache
    run the Gluon decode kernel, once per layer call, and match the reference; elsewhere the
    Triton kernel does, with the same answers."""
    import attention.triton_kernels.decode as decode_module
    from attention.triton_kernels.prefill_hopper import hopper_prefill_possible

    calls: list[int] = []
    real = decode_module.launch_decode_hopper

    def counted(*args: Any, **kw: Any) -> None:
        calls.append(int(args[-1]))
        real(*args, **kw)

    monkeypatch.setattr(decode_module, "launch_decode_hopper", counted)
    spec = make_spec(32, 8, 128, torch.bfloat16, kv_cache_dtype=cache)
    case = _case(GPU_DECODE, spec, block_size, "cuda", seed=block_size)
    backend = TritonBackend(spec, hopper_decode=True)
    plan = backend.plan(case.meta, graph=graph)
    writer = ReferenceBackend(case.spec)
    writer.write_kv(case.new_key, case.new_value, case.layer, writer.plan(case.meta))
    out = backend.attend(case.query, case.layer, plan)[: case.meta.num_real_tokens]
    assert rel_err(out, reference_output(case)) < REL_TOLERANCE[torch.bfloat16]
    on_hopper = hopper_prefill_possible(torch.device("cuda"))
    assert calls == ([3] if on_hopper else []), calls


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("chunk_len", [10**6, 256, 64])
def test_gpu_mixed_batch_decode_rows_split(chunk_len: int) -> None:
    """The one-token rows of a mixed step run chunked, naming their table rows and tokens."""
    spec = make_spec(8, 2, 128, torch.bfloat16)
    case = _case(GPU_MIXED, spec, 32, "cuda")
    backend = TritonBackend(spec, decode_chunk_len=chunk_len)
    plan = backend.plan(case.meta)
    assert isinstance(plan, TritonStepPlan) and plan.decode_rows and plan.prefill_rows
    _gpu_check(backend, case)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", DECODE_SWEEP, ids=str)
@pytest.mark.parametrize("block_size", [32, 256])
def test_every_decode_sweep_config(config: DecodeConfig, block_size: int) -> None:
    """Each configuration the benchmark sweep may pick compiles and is correct (bf16, GQA 4,
    d 128, the benchmark's shape)."""
    spec = make_spec(8, 2, 128, torch.bfloat16)
    case = _case(GPU_DECODE, spec, block_size, "cuda")
    _gpu_check(TritonBackend(spec, decode_config=config, decode_chunk_len=256), case)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", PREFILL_SWEEP, ids=str)
@pytest.mark.parametrize("block_size", [32, 256])
def test_every_prefill_sweep_config(config: PrefillConfig, block_size: int) -> None:
    spec = make_spec(8, 2, 128, torch.bfloat16)
    case = _case(GPU_MIXED, spec, block_size, "cuda")
    _gpu_check(TritonBackend(spec, prefill_config=config), case)


@pytest.mark.gpu
@needs_cuda
def test_plan_on_gpu_splits_a_long_row_to_fill_the_sms() -> None:
    spec = make_spec(8, 2, 128, torch.bfloat16)
    case = _case([(4000, 1)], spec, 32, "cuda")
    backend = TritonBackend(spec)
    plan = backend.plan(case.meta)
    assert isinstance(plan, TritonStepPlan) and plan.use_decode
    assert backend._sms(case.meta.device) == torch.cuda.get_device_properties(0).multi_processor_count
    assert plan.decode[0].schedule.num_items > 1  # one row, two KV heads: split to fill the GPU
