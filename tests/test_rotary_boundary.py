"""``rotary_write_kv``, the fused boundary before attention, on every backend available here,
against a float64 oracle: the rotated query, the rotated K and the V in exactly the step's
slots (nothing else of a NaN-poisoned cache touched), from views of one fused QKV projection."""

from __future__ import annotations

import math

import pytest
import torch

from attention import BACKENDS, AttentionSpec, LayerCache
from attention.errors import ArgumentTypeError, InvalidArgumentError, KVCacheError
from attention.quantize import dequantize
from attention.rotary import RotaryTable, rotate
from tests.paged_case import BACKENDS_UNDER_TEST, ODD, PagedCase, UnderTest, make_case, make_spec

#: One rounding of the output to its dtype (the math is float32): relative 2^-24 / 2^-11 / 2^-8
#: of values O(1), with the float32 table's angle error (~1e-7 x position) on top.
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def _inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def _fused_views(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key, value as views of one [T, (H + 2 KVH) * D] tensor (token stride > row)."""
    t, spec = case.meta.num_tokens, case.spec
    h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qkv = torch.cat([case.query.reshape(t, -1), case.new_key.reshape(t, -1), case.new_value.reshape(t, -1)], dim=1)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=1)
    return q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)


def _oracle(x: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """The rotation in float64 from the table's float32 values."""
    half = table.head_dim // 2
    rows = table.cos_sin.double()[positions]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    lo, hi = x.double()[..., :half], x.double()[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _check_boundary(under: UnderTest, spec: AttentionSpec, rows: list[tuple[int, int]], *, pad_to: int | None) -> None:
    dtype = getattr(torch, spec.dtype)
    case = make_case(rows, spec, block_size=under.block_size, device=under.device, pad_to=pad_to, seed=len(rows))
    longest = max(c + n for c, n in rows)
    table = RotaryTable.build(_inv_freq(spec.head_dim, 500.0).to(under.device), longest + 3)
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    q, k, v = _fused_views(case)
    inputs = [x.clone() for x in (q, k, v)]
    before = case.storage.clone()
    before_key, before_value = case.layer.key.clone(), case.layer.value.clone()
    out = backend.rotary_write_kv(q, k, v, case.layer, plan, table)

    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(inputs, (q, k, v), strict=True)), "inputs changed"
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    positions = case.meta.positions
    torch.testing.assert_close(out.double(), _oracle(case.query, positions, table), **TOLERANCE[dtype])

    slots = case.meta.slot_mapping
    keep = slots >= 0
    kvh, d = spec.num_kv_heads, spec.head_dim
    # Slots through the layer's logical views: an fp8 V is token-major (attention.value_layout).
    key_store = case.layer.key.reshape(-1, kvh, d)
    value_store = case.layer.value.reshape(-1, kvh, d)
    # Every slot but the step's keeps its bits (NaN poison, or the context's K/V), and so do
    # the poisoned blocks around the cache.
    untouched = torch.ones(key_store.shape[0], dtype=torch.bool, device=slots.device)
    untouched[slots[keep]] = False
    for now, then in ((key_store, before_key), (value_store, before_value)):
        assert torch.equal(_bits(now[untouched]), _bits(then.reshape(-1, kvh, d)[untouched])), "a slot changed"
    for edge in (0, -1):
        assert torch.equal(_bits(case.storage[:, edge]), _bits(before[:, edge])), "a block outside the cache changed"
    want_key = _oracle(case.new_key, positions, table)[keep]
    got_key = dequantize(key_store[slots[keep]], case.layer.k_scale, torch.float64)
    got_value = dequantize(value_store[slots[keep]], case.layer.v_scale, torch.float64)
    if spec.quantized_cache:
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative, after the scale.
        scale_k, scale_v = case.layer.k_scale.double(), case.layer.v_scale.double()  # type: ignore[union-attr]
        want_key = (want_key / scale_k[:, None]).clamp(-448, 448) * scale_k[:, None]
        want_value = (case.new_value[keep].double() / scale_v[:, None]).clamp(-448, 448) * scale_v[:, None]
        torch.testing.assert_close(got_key, want_key, atol=2e-3, rtol=0.07)
        torch.testing.assert_close(got_value, want_value, atol=2e-3, rtol=0.07)
    else:
        torch.testing.assert_close(got_key, want_key, **TOLERANCE[dtype])
        assert torch.equal(got_value, case.new_value[keep].double()), "V is stored as given"


SHAPES = [
    pytest.param(4, 4, 64, id="gqa1-d64"),
    pytest.param(8, 2, 128, id="gqa4-d128"),
    pytest.param(7, 1, 32, id="gqa7-d32"),
    pytest.param(6, 3, 40, id="gqa2-d40"),  # half of 40 pads to 32 lanes
    pytest.param(32, 32, 256, id="gqa1-d256"),  # 16 heads a tile: two query and two K/V programs
]


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_decode_and_padding(
    under: UnderTest, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    if not under.supports(dtype):
        dtype = torch.float16
    spec = make_spec(heads, kv_heads, head_dim, dtype)
    _check_boundary(under, spec, [(c, 1) for c in ODD], pad_to=len(ODD) + 2)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_write_kv_prefill_extend_and_mixed(under: UnderTest, dtype: torch.dtype) -> None:
    spec = make_spec(8, 2, 64, dtype)
    _check_boundary(under, spec, [(0, 33), (31, 2), (64, 97), (5, 1)], pad_to=None)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_rotary_write_kv_fp8_cache(under: UnderTest) -> None:
    if "float8_e4m3" not in BACKENDS[under.name].kv_cache_dtypes:
        pytest.skip(f"{under.name} has no fp8 cache")
    dtype = torch.bfloat16 if under.supports(torch.bfloat16) else torch.float16
    spec = make_spec(8, 2, 64, dtype, kv_cache_dtype="float8_e4m3")
    _check_boundary(under, spec, [(3, 1), (0, 9), (40, 1)], pad_to=4)


def test_rotate_matches_transformers_convention() -> None:
    """The table and rotation give transformers' values: ``x * cos + rotate_half(x) * sin``
    with ``cos = cat(freqs, freqs).cos()``, computed here in float64."""
    d, positions = 16, torch.tensor([0, 1, 7, 300])
    inv_freq = _inv_freq(d)
    table = RotaryTable.build(inv_freq, 301)
    x = torch.randn(4, 3, d, generator=torch.Generator().manual_seed(0))
    angles = positions[:, None].double() * inv_freq.double()[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    rotated_half = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1).double()
    expected = x.double() * emb.cos() + rotated_half * emb.sin()
    torch.testing.assert_close(rotate(x, positions, table).double(), expected, atol=1e-4, rtol=1e-5)
    assert math.isclose(float(table.cos_sin[300, 0]), math.cos(300.0), abs_tol=1e-6)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_rotary_write_kv_refuses_bad_arguments_and_changes_nothing(under: UnderTest) -> None:
    spec = make_spec(4, 2, 32, torch.float16)
    case = make_case([(3, 2)], spec, block_size=under.block_size, device=under.device)
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    q, k, v = _fused_views(case)
    table = RotaryTable.build(_inv_freq(32).to(under.device), 16)
    before = case.storage.clone()
    bad: list[tuple[dict[str, object], type[KVCacheError], str]] = [
        ({"rotary": RotaryTable.build(_inv_freq(32).to(under.device), 4)}, InvalidArgumentError, "covers 4 positions"),
        ({"rotary": RotaryTable.build(_inv_freq(64).to(under.device), 16)}, InvalidArgumentError, "head_dim 64"),
        ({"rotary": table.cos_sin}, ArgumentTypeError, "RotaryTable"),
        ({"query": q[:, :, ::2].repeat(1, 1, 2)[:, :3]}, InvalidArgumentError, "query: expected shape"),
        ({"key": k.to(torch.float32)}, InvalidArgumentError, "key: expected dtype"),
        ({"value": v.transpose(1, 2).contiguous().transpose(1, 2)}, InvalidArgumentError, "unit stride"),
    ]
    for change, error, words in bad:
        args: dict[str, object] = {"query": q, "key": k, "value": v, "rotary": table, **change}
        with pytest.raises(error, match=words):
            backend.rotary_write_kv(args["query"], args["key"], args["value"], case.layer, plan, args["rotary"])  # type: ignore[arg-type]
        assert torch.equal(_bits(case.storage), _bits(before)), f"{words}: the cache changed"
    with pytest.raises(InvalidArgumentError, match="cos_sin"):
        RotaryTable(torch.zeros(4, 7))
    assert isinstance(case.layer, LayerCache)
