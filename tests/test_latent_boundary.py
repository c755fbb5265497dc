"""``rotary_write_latent``, MLA's boundary before attention, on every backend available here:
the query ``[absorbed, rotate(q_pe)]`` and the latent ``[c, rotate(k_pe)]`` in exactly the
step's slots of a NaN-poisoned cache (nothing else touched), against a float64 oracle; the
fused kernel against the composed torch form bit for bit where Triton runs in its
interpreter; interleaved rotary channels; an fp8 latent; bad arguments refused with nothing
written."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from attention import AttentionBackend, AttentionMetadata, AttentionSpec, LayerCache
from attention.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedSettingError
from attention.quantize import dequantize
from attention.rotary import RotaryTable
from attention.triton_kernels import kernels_interpreted
from kvcache import MetadataBuilder, ScheduledRow
from tests.paged_case import BACKENDS_UNDER_TEST, ODD, UnderTest, scrambled_manager

pytestmark = pytest.mark.kernel

RANK, ROPE, HEADS = 48, 16, 5

#: One rounding of the output to its dtype (float32 math), the table's angle error on top.
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}


@dataclass
class LatentCase:
    spec: AttentionSpec
    layer: LayerCache
    storage: torch.Tensor  # [num_blocks + 2, block_size, 1, r + e]: one poisoned block each side
    meta: AttentionMetadata
    table: RotaryTable
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # as the model passes them


def _case(under: UnderTest, rows: list[tuple[int, int]], dtype: torch.dtype, *, fp8: bool = False) -> LatentCase:
    """Rows of (context, new) tokens; the inputs are views of two projections' outputs (token
    strides wider than a row), as ``examples.model.latent_attention`` passes them."""
    gen = torch.Generator().manual_seed(len(rows) * 7 + fp8)
    device, block = under.device, under.block_size
    spec = AttentionSpec(
        HEADS, 1, RANK + ROPE, dtype=str(dtype).removeprefix("torch."), latent_rank=RANK,
        kv_cache_dtype="float8_e4m3" if fp8 else None,
    )  # fmt: skip
    need = sum(-(-(c + n) // block) for c, n in rows)
    manager = scrambled_manager(need + 2, block, seed=len(rows))
    for i, (context, new) in enumerate(rows):
        manager.allocate(i, context + new)
    storage = torch.full((manager.num_blocks + 2, block, 1, RANK + ROPE), float("nan"), device=device)
    storage = storage.to(torch.float8_e4m3fn if fp8 else dtype)
    scale = torch.tensor([0.03], device=device) if fp8 else None
    layer = LayerCache(storage[1:-1], storage[1:-1], index=0, k_scale=scale, v_scale=scale)
    context = [ScheduledRow(i, c, start=0) for i, (c, _) in enumerate(rows) if c > 0]
    if context:  # the context's tokens planned first (their latents stay NaN: nothing reads them)
        MetadataBuilder(device).build(manager, context)
    meta = MetadataBuilder(device).build(
        manager, [ScheduledRow(i, n, start=c) for i, (c, n) in enumerate(rows)], pad_to=len(rows) + 2
    )
    t = meta.num_tokens
    q = torch.randn(t, HEADS * (RANK + 3 + ROPE), generator=gen).to(dtype=dtype, device=device)
    q_latent, _, q_pe = q.view(t, HEADS, RANK + 3 + ROPE).split([RANK, 3, ROPE], dim=-1)
    kv = torch.randn(t, RANK + ROPE + 5, generator=gen).to(dtype=dtype, device=device)
    latent, key_pe, _ = kv.split([RANK, ROPE, 5], dim=-1)
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE)
    table = RotaryTable.build(inv_freq.to(device), max(c + n for c, n in rows) + 3)
    return LatentCase(spec, layer, storage, meta, table, (q_latent, q_pe, latent, key_pe))


def _halves(x: torch.Tensor, pairs: bool) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if pairs else x


def _rotated64(x: torch.Tensor, positions: torch.Tensor, table: RotaryTable, pairs: bool) -> torch.Tensor:
    """x [T, heads, e] rotated in float64 from the table's float32 values."""
    x = _halves(x.double(), pairs)
    half = ROPE // 2
    rows = table.cos_sin.double()[positions]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _run(backend: AttentionBackend, case: LatentCase, pairs: bool) -> torch.Tensor:
    return backend.rotary_write_latent(*case.inputs, case.layer, backend.plan(case.meta), case.table, pairs=pairs)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pairs", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_the_query_and_the_latent_match_float64(under: UnderTest, dtype: torch.dtype, pairs: bool, step: str) -> None:
    if under.name == "flash_attn":
        pytest.skip("flash_attn serves no latent cache")
    rows = [(c, 1) for c in ODD] if step == "decode" else [(0, 37), (5, 1), (40, 3)]
    case = _case(under, rows, dtype)
    before = case.storage.clone()
    inputs = [x.clone() for x in case.inputs]
    query = _run(under.make(case.spec), case, pairs)

    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(inputs, case.inputs, strict=True)), "inputs changed"
    q_latent, q_pe, latent, key_pe = case.inputs
    positions = case.meta.positions
    assert query.shape == (case.meta.num_tokens, HEADS, RANK + ROPE) and query.dtype == dtype and query.is_contiguous()
    assert torch.equal(_bits(query[..., :RANK]), _bits(q_latent)), "the absorbed query is copied as it is"
    want_query_pe = _rotated64(q_pe, positions, case.table, pairs)
    torch.testing.assert_close(query[..., RANK:].double(), want_query_pe, **TOLERANCE[dtype])

    slots = case.meta.slot_mapping
    keep = slots >= 0
    store = case.layer.key.reshape(-1, RANK + ROPE)
    written = torch.zeros(store.shape[0], dtype=torch.bool, device=slots.device)
    written[slots[keep]] = True
    assert torch.equal(_bits(store[~written]), _bits(before[1:-1].reshape(-1, RANK + ROPE)[~written])), "a slot changed"
    for edge in (0, -1):
        assert torch.equal(_bits(case.storage[edge]), _bits(before[edge])), "a block outside the cache changed"
    rows_written = store[slots[keep]]
    assert torch.equal(_bits(rows_written[:, :RANK]), _bits(latent[keep])), "the latent is stored as given"
    want_key = _rotated64(key_pe[keep].unsqueeze(1), positions[keep], case.table, pairs)[:, 0]
    torch.testing.assert_close(rows_written[:, RANK:].double(), want_key, **TOLERANCE[dtype])


@pytest.mark.parametrize("under", [p for p in BACKENDS_UNDER_TEST if p.values[0].name != "flash_attn"])
def test_a_step_with_decompressed_rows_reads_no_absorbed_query_for_them(under: UnderTest) -> None:
    """On a step whose first row attends decompressed (``plan.latent_prefill``), the other
    tokens get their absorbed query as given, every token its rotated rotary channels and its
    latent in the cache, and the decompressed tokens' rows of ``query_latent`` are not needed:
    NaN there changes nothing else."""
    case = _case(under, [(0, 37), (5, 1), (40, 3)], torch.bfloat16)
    backend = under.make(case.spec)
    backend.latent_prefill_min_tokens = 16
    plan = backend.plan(case.meta)
    prefill = plan.latent_prefill
    assert prefill is not None and prefill.rows == (0,)
    t = case.meta.num_tokens
    decompressed, absorbed = prefill.token_index, prefill.absorbed_index
    assert torch.equal(torch.cat((decompressed, absorbed)).sort().values.cpu(), torch.arange(t))
    q_latent, q_pe, latent, key_pe = case.inputs
    q_latent[decompressed] = float("nan")
    query = backend.rotary_write_latent(q_latent, q_pe, latent, key_pe, case.layer, plan, case.table)

    slots, positions = case.meta.slot_mapping, case.meta.positions
    real = absorbed[slots[absorbed] >= 0]  # (padding tokens too may be left unset)
    assert real.numel() == 4 and torch.equal(_bits(query[real, :, :RANK]), _bits(q_latent[real]))
    want_query_pe = _rotated64(q_pe, positions, case.table, False)
    torch.testing.assert_close(query[..., RANK:].double(), want_query_pe, **TOLERANCE[torch.bfloat16])
    keep = slots >= 0
    rows_written = case.layer.key.reshape(-1, RANK + ROPE)[slots[keep]]
    assert keep.sum() == 41 and torch.equal(_bits(rows_written[:, :RANK]), _bits(latent[keep]))
    want_key = _rotated64(key_pe[keep].unsqueeze(1), positions[keep], case.table, False)[:, 0]
    torch.testing.assert_close(rows_written[:, RANK:].double(), want_key, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("under", [p for p in BACKENDS_UNDER_TEST if p.values[0].name == "triton"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_fused_kernel_stores_what_the_composed_form_stores(under: UnderTest, fp8: bool) -> None:
    """The Triton kernel against the base class's torch composition on the same inputs: the
    same bits under the interpreter; on a GPU the rotation's products may fuse into FMAs, so
    within one rounding of the dtype (after the fp8 scale: one e4m3 step)."""
    rows = [(c, 1) for c in ODD] + [(3, 20)]
    fused, composed = (_case(under, rows, torch.bfloat16, fp8=fp8) for _ in range(2))  # the same case twice
    backend = under.make(fused.spec)
    fused_query = _run(backend, fused, pairs=True)
    composed_query = AttentionBackend._rotary_write_latent(
        backend, *composed.inputs, composed.layer, backend.plan(composed.meta), composed.table, True
    )
    fused_store, composed_store = fused.storage, composed.storage
    if kernels_interpreted():
        assert torch.equal(_bits(fused_query), _bits(composed_query))
        assert torch.equal(_bits(fused_store), _bits(composed_store))
        return
    torch.testing.assert_close(fused_query, composed_query, atol=1e-6, rtol=2**-8)
    got = dequantize(fused_store.reshape(-1, 1, RANK + ROPE), fused.layer.k_scale, torch.float64)
    want = dequantize(composed_store.reshape(-1, 1, RANK + ROPE), fused.layer.k_scale, torch.float64)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=2**-3 if fp8 else 2**-8, equal_nan=True)


@pytest.mark.parametrize("under", [p for p in BACKENDS_UNDER_TEST if p.values[0].name != "flash_attn"])
def test_an_fp8_latent_is_stored_scaled(under: UnderTest) -> None:
    case = _case(under, [(c, 1) for c in ODD], torch.bfloat16, fp8=True)
    _run(under.make(case.spec), case, pairs=False)
    slots = case.meta.slot_mapping[case.meta.slot_mapping >= 0]
    store = case.layer.key.reshape(-1, 1, RANK + ROPE)[slots]
    got = dequantize(store, case.layer.k_scale, torch.float64)[:, 0]
    latent = case.inputs[2][case.meta.slot_mapping >= 0].double()
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 relative, after the scale.
    torch.testing.assert_close(got[:, :RANK], latent, atol=2e-3, rtol=0.07)


def _bad_arguments(case: LatentCase) -> list[tuple[str, dict[str, object], type[Exception]]]:
    q_latent, q_pe, latent, key_pe = case.inputs
    t = case.meta.num_tokens
    return [
        ("query_latent", {"query_latent": q_latent[:-1]}, InvalidArgumentError),
        ("query_pe", {"query_pe": q_pe[..., :-2]}, InvalidArgumentError),
        ("latent", {"latent": latent.double()}, InvalidArgumentError),
        ("key_pe", {"key_pe": torch.empty(t, 2 * ROPE, dtype=key_pe.dtype, device=key_pe.device)[:, ::2]},
         InvalidArgumentError),
        ("query_latent", {"query_latent": "q"}, ArgumentTypeError),
        ("rotary", {"rotary": RotaryTable.build(torch.ones(ROPE), 8).cos_sin}, ArgumentTypeError),
        ("rotary", {"rotary": RotaryTable.build(torch.ones(ROPE, device=latent.device), 512)}, InvalidArgumentError),
        ("rotary", {"rotary": RotaryTable.build(torch.ones(ROPE // 2, device=latent.device), 4)}, InvalidArgumentError),
        ("pairs", {"pairs": 1}, ArgumentTypeError),
    ]  # fmt: skip


@pytest.mark.parametrize("under", [p for p in BACKENDS_UNDER_TEST if p.values[0].name != "flash_attn"])
def test_bad_arguments_are_refused_naming_them_with_nothing_written(under: UnderTest) -> None:
    case = _case(under, [(c, 1) for c in ODD], torch.float32)
    backend = under.make(case.spec)
    plan = backend.plan(case.meta)
    before = case.storage.clone()
    names = ("query_latent", "query_pe", "latent", "key_pe")
    for name, change, error in _bad_arguments(case):
        args: dict[str, object] = {**dict(zip(names, case.inputs, strict=True)), "rotary": case.table, "pairs": False}
        args.update(change)
        with pytest.raises(error, match=name):
            backend.rotary_write_latent(layer=case.layer, plan=plan, **args)  # type: ignore[arg-type]
        assert torch.equal(_bits(case.storage), _bits(before)), f"bad {name} wrote into the cache"


def test_an_ordinary_cache_is_pointed_to_rotary_write_kv() -> None:
    from tests.paged_case import make_case, make_spec

    case = make_case([(3, 1)], make_spec(4, 1, 64, torch.float32), block_size=32, device="cpu")
    backend = BACKENDS_UNDER_TEST[0].values[0].make(case.spec)  # the reference backend on CPU
    q = torch.zeros(1, 4, 48)
    with pytest.raises(UnsupportedSettingError, match="rotary_write_kv"):
        backend.rotary_write_latent(
            q, q[..., :16], q[:, 0], q[:, 0, :16], case.layer, backend.plan(case.meta),
            RotaryTable.build(torch.ones(8), 8),
        )  # fmt: skip


@pytest.mark.parametrize("under", [p for p in BACKENDS_UNDER_TEST if p.values[0].name == "triton"])
def test_corrupt_slots_and_positions_on_the_device_stay_inside_the_cache(under: UnderTest) -> None:
    """Device metadata is not trusted to index: slot ids outside the cache write nothing and
    positions outside the table are clamped into it (as attention.rotary.rotate clamps)."""
    case = _case(under, [(c, 1) for c in ODD], torch.bfloat16)
    backend = under.make(case.spec)
    plan = backend.plan(case.meta)
    slots, positions = case.meta.slot_mapping, case.meta.positions
    good = slots.clone()
    slots[0], slots[1], slots[2] = 10**9, -5, case.layer.key.shape[0] * case.layer.key.shape[1]
    positions[0], positions[1] = 10**9, -3
    before = case.storage.clone()
    query = backend.rotary_write_latent(*case.inputs, case.layer, plan, case.table)
    assert torch.isfinite(query.float()).all()
    want = _rotated64(case.inputs[1][:2], positions[:2].clamp(0, case.table.max_positions - 1), case.table, False)
    torch.testing.assert_close(query[:2, :, RANK:].double(), want, **TOLERANCE[torch.bfloat16])
    store, then = case.layer.key.reshape(-1, RANK + ROPE), before[1:-1].reshape(-1, RANK + ROPE)
    written = torch.zeros(store.shape[0], dtype=torch.bool, device=store.device)
    written[good[3:][good[3:] >= 0]] = True
    assert torch.equal(_bits(store[~written]), _bits(then[~written])), "a corrupt slot wrote into the cache"
    for edge in (0, -1):
        assert torch.equal(_bits(case.storage[edge]), _bits(before[edge])), "a block outside the cache changed"
