"""The contract every attention backend keeps, checked against the float64 reference.

One suite, parametrized over every backend available here (``BACKENDS_UNDER_TEST``): the
reference on CPU (and CUDA), triton in Triton's CPU interpreter without a GPU and compiled on
a GPU, flash_attn on a GPU. A new backend is tested by adding its name to the backend table.

Every case goes through a real BlockManager with a scrambled free queue (shuffled,
non-contiguous block ids) and a NaN-poisoned cache with a NaN block on each side (a read of an
unwritten slot, a padding entry or past the cache shows as NaN, which never passes), and the
backend writes the step's new K/V with its own ``write_kv`` before attending.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import pytest
import torch

from attention import BACKENDS, AttentionSpec, get_backend
from attention.base import AttentionBackend
from attention.errors import InvalidArgumentError, KVCacheError, MetadataError
from tests.paged_case import PagedCase, make_case, make_spec, reference_output

# Element-wise tolerances against a float64 oracle on the same (rounded) inputs; outputs are
# O(1). fp32: summation order (~1e-6; on a GPU also tf32x3 products, ~2^-21 each). fp16: P is
# rounded to 11 bits before the P@V product and the output is stored in fp16 (~5e-4 relative
# each). bf16: the same with 8 bits (~4e-3 each).
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
ODD = [1, 31, 32, 33, 97]


@dataclass(frozen=True)
class UnderTest:
    """A backend on a device, with the block size its tests use."""

    name: str
    device: str
    block_size: int

    def make(self, spec: AttentionSpec) -> AttentionBackend:
        return get_backend(self.name, spec)

    def supports(self, dtype: torch.dtype) -> bool:
        return str(dtype).removeprefix("torch.") in BACKENDS[self.name].dtypes


def _under_test() -> list[UnderTest]:
    cuda = torch.cuda.is_available()
    found = [UnderTest("reference", "cpu", 32)]
    for name, info in BACKENDS.items():
        if info.library is not None and importlib.util.find_spec(info.library) is None:
            continue
        block = info.block_sizes.factor
        if cuda and "cuda" in info.devices:
            found.append(UnderTest(name, "cuda", block))
        elif name == "triton" and not cuda:
            found.append(UnderTest(name, "cpu", block))  # the CPU interpreter (conftest.py)
    return found


BACKENDS_UNDER_TEST = [pytest.param(b, id=f"{b.name}-{b.device}") for b in _under_test()]


def _run(
    under: UnderTest,
    rows: list[tuple[int, int]],
    spec: AttentionSpec,
    *,
    seed: int = 0,
    pad_to: int | None = None,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, PagedCase]:
    """Write the step's K/V and attend with the backend; return (output, oracle, case)."""
    case = make_case(
        rows, spec, block_size=block_size or under.block_size, device=under.device, seed=seed, pad_to=pad_to
    )
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    out = backend.attend(case.query, case.layer, plan)
    return out[: case.meta.num_real_tokens], reference_output(case), case


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "NaN in the output: a kernel read an unwritten slot"
    torch.testing.assert_close(out.double(), ref.double(), **TOLERANCE[dtype])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN == NaN and -0.0 != 0.0 in comparisons."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- write_kv ----------------------------------------------------------------------------


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_writes_exactly_the_new_slots(under: UnderTest, dtype: torch.dtype) -> None:
    if not under.supports(dtype):
        pytest.skip(f"{under.name} does not compute in {dtype}")
    spec = make_spec(6, 3, 40, dtype)  # head_dim 40 pads to 64 lanes in the kernels
    case = make_case(
        [(3, 5), (0, 1), (under.block_size - 1, 2)], spec, block_size=under.block_size, device=under.device, pad_to=5
    )
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    before = case.storage.clone()
    # Views into a fused projection: token stride 2 * kvh * d, not contiguous.
    fused = torch.stack([case.new_key, case.new_value], dim=1)
    backend.write_kv(fused[:, 0], fused[:, 1], case.layer, plan)
    expect = before.clone()
    slots = case.meta.slot_mapping
    keep = slots >= 0
    kvh, d = spec.num_kv_heads, spec.head_dim
    expect[0, 1:-1].reshape(-1, kvh, d)[slots[keep]] = case.new_key[keep]
    expect[1, 1:-1].reshape(-1, kvh, d)[slots[keep]] = case.new_value[keep]
    assert torch.equal(_bits(case.storage), _bits(expect)), "write_kv changed a slot it was not given"


# ---- attend ------------------------------------------------------------------------------

SHAPES = [
    # heads, kv_heads (GQA = heads / kv_heads), head_dim
    pytest.param(4, 4, 64, id="gqa1-d64"),
    pytest.param(8, 2, 128, id="gqa4-d128"),
    pytest.param(7, 1, 32, id="gqa7-d32"),
    pytest.param(6, 3, 40, id="gqa2-d40"),
]


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_odd_lengths(under: UnderTest, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    if not under.supports(dtype):
        dtype = torch.float16
    spec = make_spec(heads, kv_heads, head_dim, dtype)
    out, ref, _ = _run(under, [(c, 1) for c in ODD], spec)
    _check(out, ref, dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_and_extend(under: UnderTest, dtype: torch.dtype) -> None:
    spec = make_spec(8, 2, 64, dtype)
    # Whole prompts (context 0), extends after cached tokens, partial last blocks.
    out, ref, _ = _run(under, [(0, 33), (31, 2), (64, 97), (0, 1)], spec, seed=1)
    _check(out, ref, dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_mixed_batch(under: UnderTest) -> None:
    dtype = torch.float16
    spec = make_spec(8, 4, 64, dtype)
    rows = [(40, 1), (0, 20), (7, 1), (33, 9), (100, 1)]
    out, ref, _ = _run(under, rows, spec, seed=2)
    _check(out, ref, dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_padding_rows_read_and_write_nothing(under: UnderTest) -> None:
    """A CUDA-graph bucket: rows past the real ones have seq_len 0 and slot -1; the real rows
    are exact and no cache slot outside the real new tokens changes."""
    dtype = torch.float16
    spec = make_spec(4, 2, 64, dtype)
    case = make_case([(5, 1), (40, 1)], spec, block_size=under.block_size, device=under.device, pad_to=4)
    backend = under.make(spec)
    graph = BACKENDS[under.name].cuda_graphs
    plan = backend.plan(case.meta, graph=graph)
    before = case.storage.clone()
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    out = backend.attend(case.query, case.layer, plan)
    changed = (_bits(case.storage) != _bits(before)).flatten(3).any(-1)  # [2, blocks + 2, block_size]
    assert not changed[:, 0].any() and not changed[:, -1].any(), "a write landed outside the cache"
    real = case.meta.slot_mapping[: case.meta.num_real_tokens]
    expect = torch.zeros_like(changed[:, 1:-1]).flatten(1)
    expect[:, real] = True
    assert torch.equal(changed[:, 1:-1].flatten(1), expect), "a padding row wrote K/V"
    _check(out[:2], reference_output(case), dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_sliding_window(under: UnderTest) -> None:
    dtype = torch.float16
    spec = make_spec(4, 2, 64, dtype, sliding_window=37)
    out, ref, _ = _run(under, [(100, 1), (0, 50), (20, 30), (36, 1)], spec, seed=3)
    _check(out, ref, dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_out_argument_and_strided_query(under: UnderTest) -> None:
    dtype = torch.float16
    spec = make_spec(4, 2, 64, dtype, softmax_scale=0.3)
    case = make_case([(10, 1), (0, 7)], spec, block_size=under.block_size, device=under.device)
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    wide = torch.randn(case.query.shape[0], spec.num_heads, 2 * spec.head_dim).to(case.query)
    wide[..., ::2] = case.query  # a strided view with the same values
    out = torch.full_like(case.query, float("nan"))
    result = backend.attend(wide[..., ::2], case.layer, plan, out=out)
    assert result is out
    _check(out, reference_output(case), dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("query_heads", "query: expected shape"),
        ("query_dtype", "query: expected dtype"),
        ("key_shape", "key: expected shape"),
        ("cache_heads", "layer.key: expected shape"),
        ("foreign_plan", "plan: made by"),
    ],
)
def test_bad_arguments_raise_before_any_kernel(under: UnderTest, change: str, message: str) -> None:
    dtype = torch.float16
    spec = make_spec(4, 2, 64, dtype)
    case = make_case([(10, 1), (3, 4)], spec, block_size=under.block_size, device=under.device)
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    before = case.storage.clone()
    query, key, layer = case.query, case.new_key, case.layer
    if change == "query_heads":
        query = query[:, :3]
    elif change == "query_dtype":
        query = query.float()
    elif change == "key_shape":
        key = key[:-1]
    elif change == "cache_heads":
        layer = dataclasses.replace(layer, key=layer.key[:, :, :1], value=layer.value[:, :, :1])
    elif change == "foreign_plan":
        plan = get_backend("reference", make_spec(8, 2, 64, dtype)).plan(case.meta)
    with pytest.raises(KVCacheError, match=message):
        if change.startswith("query"):
            backend.attend(query, layer, plan)
        else:
            backend.write_kv(key, case.new_value, layer, plan)
    assert torch.equal(_bits(case.storage), _bits(before)), "a refused call wrote to the cache"


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_metadata_inconsistent_with_itself_is_refused_at_plan(under: UnderTest) -> None:
    spec = make_spec(4, 2, 64, torch.float16)
    case = make_case([(10, 1), (3, 4)], spec, block_size=under.block_size, device=under.device)
    bad = dataclasses.replace(case.meta, seq_lens_host=(0, 7))  # query_len 1 > seq_len 0
    with pytest.raises(MetadataError, match="query_len 1 must be in"):
        under.make(spec).plan(bad)
    with pytest.raises(InvalidArgumentError):
        under.make(spec).plan(dataclasses.replace(case.meta, slot_mapping=case.meta.slot_mapping.int()))


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_cache(under: UnderTest, dtype: torch.dtype) -> None:
    """An fp8 cache: writes quantize with the layer's per-KV-head scales, reads dequantize.
    The oracle attends over the dequantized values the cache holds, so the only extra error
    is the kernels' own arithmetic (as for the 16-bit tolerances)."""
    if "float8_e4m3" not in BACKENDS[under.name].kv_cache_dtypes:
        pytest.skip(f"{under.name} has no fp8 cache")
    spec = make_spec(8, 2, 64, dtype, kv_cache_dtype="float8_e4m3")
    out, ref, case = _run(under, [(40, 1), (0, 17), (33, 5), (97, 1)], spec, seed=4)
    assert case.layer.key.dtype == torch.float8_e4m3fn
    _check(out, ref, dtype)
