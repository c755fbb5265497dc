"""The contract every attention backend keeps, checked against the float64 reference.

One suite, parametrized over every backend available here (``BACKENDS_UNDER_TEST``,
tests/paged_case.py): the reference on CPU (and CUDA), triton in Triton's CPU interpreter
without a GPU and compiled on a GPU, flash_attn on a GPU. A new backend is tested by adding its
name to the backend table. What is specific to one backend (its tuning knobs, its launch
parameters, the library's own limits) lives in that backend's file; hostile metadata is
tests/test_backend_metadata_fuzz.py.

Every case goes through a real BlockManager with a scrambled free queue (shuffled,
non-contiguous block ids) and a NaN-poisoned cache with a NaN block on each side (a read of an
unwritten slot, a padding entry or past the cache shows as NaN, which never passes), and the
backend writes the step's new K/V with its own ``write_kv`` before attending.

Small shapes run everywhere (the interpreter is slow); GPU-sized shapes (head_dim 256, GQA 8,
rows of thousands of tokens, block 512, caches past 2**31 elements) run on CUDA devices only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention import BACKENDS, AttentionSpec, get_backend
from attention.errors import InvalidArgumentError, KVCacheError, MetadataError, UnsupportedSettingError
from attention.token_scales import quantize_rows
from attention.value_layout import is_token_major
from tests.paged_case import (
    BACKENDS_UNDER_TEST,
    ODD,
    REL_TOLERANCE,
    TOLERANCE,
    PagedCase,
    UnderTest,
    int8_output_dtype,
    int8_views,
    make_case,
    make_spec,
    reference_output,
    rel_err,
)


def _run(
    under: UnderTest,
    rows: list[tuple[int, int]],
    spec: AttentionSpec,
    *,
    seed: int = 0,
    pad_to: int | None = None,
    block_size: int | None = None,
    token_major_values: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, PagedCase]:
    """Write the step's K/V and attend with the backend; return (output, oracle, case)."""
    case = make_case(
        rows, spec, block_size=block_size or under.block_size, device=under.device, seed=seed, pad_to=pad_to,
        token_major_values=token_major_values,
    )  # fmt: skip
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


def _block_sizes(under: UnderTest, multiples: tuple[int, ...]) -> list[int]:
    """Multiples of the backend's smallest block size that its table accepts."""
    rule = BACKENDS[under.name].block_sizes
    return [m * under.block_size for m in multiples if rule.allows(m * under.block_size)]


# ---- write_kv ----------------------------------------------------------------------------


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("multiple", [1, 2], ids=["block-x1", "block-x2"])
def test_write_kv_writes_exactly_the_new_slots(under: UnderTest, dtype: torch.dtype, multiple: int) -> None:
    if not under.supports(dtype):
        pytest.skip(f"{under.name} does not compute in {dtype}")
    spec = make_spec(6, 3, 40, dtype)  # head_dim 40 pads to 64 lanes in the kernels
    bs = multiple * under.block_size
    case = make_case([(3, 5), (0, 1), (bs - 1, 2)], spec, block_size=bs, device=under.device, pad_to=5)
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
@pytest.mark.parametrize("multiple", [2, 3, 8], ids=lambda m: f"block-x{m}")
def test_larger_block_sizes(under: UnderTest, multiple: int) -> None:
    """Blocks of several tiles (and, at x3, not a power of two): rows ending just before, at
    and after block edges, plus one extend row."""
    sizes = _block_sizes(under, (multiple,))
    if not sizes:
        pytest.skip(f"{under.name} takes no block size {multiple * under.block_size}")
    bs = sizes[0]
    dtype = torch.float16
    spec = make_spec(4, 2, 32, dtype)
    rows = [(0, 1), (bs - 2, 1), (bs - 1, 1), (bs, 1), (2 * bs + 40, 1), (bs - 5, 17)]
    out, ref, _ = _run(under, rows, spec, seed=multiple, block_size=bs)
    _check(out, ref, dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize(
    "rows", [[(5, 1), (40, 1)], [(20, 13), (40, 1)]], ids=["decode-graph-bucket", "prefill-padded"]
)
def test_padding_rows_read_and_write_nothing(under: UnderTest, rows: list[tuple[int, int]]) -> None:
    """A padded step (a CUDA-graph bucket for decode): rows past the real ones have seq_len 0
    and slot -1; the real rows are exact and no cache slot outside the real new tokens
    changes."""
    dtype = torch.float16
    spec = make_spec(4, 2, 64, dtype)
    case = make_case(rows, spec, block_size=under.block_size, device=under.device, pad_to=5)
    backend = under.make(spec)
    graph = BACKENDS[under.name].cuda_graphs and case.meta.is_pure_decode
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
    _check(out[: case.meta.num_real_tokens], reference_output(case), dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_sliding_window(under: UnderTest) -> None:
    dtype = torch.float16
    spec = make_spec(4, 2, 64, dtype, sliding_window=37)
    out, ref, _ = _run(under, [(100, 1), (0, 50), (20, 30), (36, 1)], spec, seed=3)
    _check(out, ref, dtype)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("rows", [[(30, 1), (64, 1)], [(10, 1), (0, 7)]], ids=["decode", "mixed"])
@pytest.mark.parametrize("layout", ["fused-query", "strided-query-and-out"])
def test_out_argument_scale_and_strided_tensors(under: UnderTest, rows: list[tuple[int, int]], layout: str) -> None:
    """``out=`` is written and returned; queries and outputs need not be contiguous (a view of
    a fused QKV projection: token stride 3 * heads * d; or a stride-2 last dim)."""
    dtype = torch.float16
    spec = make_spec(4, 2, 64, dtype, softmax_scale=0.3)
    case = make_case(rows, spec, block_size=under.block_size, device=under.device)
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    t, h, d = case.query.shape
    if layout == "fused-query":
        fused = torch.randn(t, 3, h, d).to(case.query)
        fused[:, 1] = case.query
        query, out = fused[:, 1], torch.full_like(case.query, float("nan"))
    else:
        wide = torch.randn(t, h, 2 * d).to(case.query)
        wide[..., ::2] = case.query  # a strided view with the same values
        query, out = wide[..., ::2], torch.full((t, h, 2 * d), float("nan")).to(case.query)[..., ::2]
    result = backend.attend(query, case.layer, plan, out=out)
    assert result is out
    _check(out, reference_output(case), dtype)


# ---- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("query_heads", "query: expected shape"),
        ("query_tokens", "query: expected shape"),
        ("query_dtype", "query: expected dtype"),
        ("key_shape", "key: expected shape"),
        ("cache_heads", "layer.key: expected shape"),
        ("cache_dtype", "layer.key: expected dtype"),
        ("cache_block_48", "block_size 48 is refused"),
        ("cache_not_contiguous", "expected contiguous"),
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
    elif change == "query_tokens":
        query = query[:0]
    elif change == "query_dtype":
        query = query.float()
    elif change == "key_shape":
        key = key[:-1]
    elif change == "cache_heads":
        layer = dataclasses.replace(layer, key=layer.key[:, :, :1], value=layer.value[:, :, :1])
    elif change == "cache_dtype":
        layer = dataclasses.replace(layer, key=layer.key.double(), value=layer.value.double())
    elif change == "cache_block_48":
        blocks = torch.zeros(4, 48, 2, 64, dtype=dtype, device=under.device)
        layer = dataclasses.replace(layer, key=blocks, value=blocks.clone())
    elif change == "cache_not_contiguous":
        layer = dataclasses.replace(
            layer, key=layer.key.transpose(2, 3).contiguous().transpose(2, 3), value=layer.value
        )
    elif change == "foreign_plan":
        plan = get_backend("reference", make_spec(8, 2, 64, dtype)).plan(case.meta)
    with pytest.raises(KVCacheError, match=message):
        if change.startswith("query"):
            backend.attend(query, layer, plan)
        else:
            backend.write_kv(key, case.new_value, layer, plan)
    assert torch.equal(_bits(case.storage), _bits(before)), "a refused call wrote to the cache"


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_declared_limits_are_refused_at_construction(under: UnderTest) -> None:
    """Just past the head_dim and outside the dtypes the backend table declares: refused when
    the backend is built for the spec, naming the field."""
    info = BACKENDS[under.name]
    with pytest.raises(UnsupportedSettingError, match=rf"spec\.head_dim: {info.head_dims.maximum + 8} is refused"):
        get_backend(under.name, make_spec(4, 2, info.head_dims.maximum + 8, torch.float16))
    get_backend(under.name, make_spec(4, 2, info.head_dims.maximum, torch.float16))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        if not under.supports(dtype):
            with pytest.raises(UnsupportedSettingError, match=r"spec\.dtype"):
                get_backend(under.name, make_spec(4, 2, 64, dtype))


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
@pytest.mark.parametrize("token_major", [True, False], ids=["v-token-major", "v-contiguous"])
def test_fp8_cache(under: UnderTest, dtype: torch.dtype, token_major: bool) -> None:
    """An fp8 cache: writes quantize with the layer's per-KV-head scales, reads dequantize.
    The oracle attends over the dequantized values the cache holds, so the only extra error
    is the kernels' own arithmetic (as for the 16-bit tolerances). V token-major, as kvcache
    allocates it, or contiguous (``attention.value_layout``): both are read."""
    if "float8_e4m3" not in BACKENDS[under.name].kv_cache_dtypes:
        pytest.skip(f"{under.name} has no fp8 cache")
    spec = make_spec(8, 2, 64, dtype, kv_cache_dtype="float8_e4m3")
    rows = [(40, 1), (0, 17), (33, 5), (97, 1)]
    out, ref, case = _run(under, rows, spec, seed=4, token_major_values=token_major)
    assert case.layer.key.dtype == torch.float8_e4m3fn
    assert is_token_major(case.layer.value) == token_major
    _check(out, ref, dtype)


def _int8_rows_written(case: PagedCase, before: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """What an int8 write of the case's new K/V must leave in its storage: ``before`` with each
    written slot's values and per-token scales replaced (every other byte as it was)."""
    expect = before.clone()
    views = int8_views(expect, case.layer.block_size)
    keep = slots >= 0
    bs = case.layer.block_size
    blocks, offsets = slots[keep] // bs, slots[keep] % bs
    for cache, scales, x in ((views.key, views.k_scale, case.new_key), (views.value, views.v_scale, case.new_value)):
        q, scale = quantize_rows(x[keep])
        cache[blocks, offsets] = q
        assert scales is not None
        scales[blocks, offsets] = scale
    return expect


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_cache(under: UnderTest, dtype: torch.dtype) -> None:
    """An int8 cache with a scale per (token, KV head) (``attention.token_scales``): a write
    stores each new row's int8 values and fp16 scale exactly as the reference quantizes them
    and touches no other byte; attention reads values times scales. The oracle attends over
    the dequantized values, so the only extra error is the kernels' own arithmetic. The
    cache's unwritten bytes are 0x7E, whose scales are NaN: a read past a row's end shows."""
    if "int8" not in BACKENDS[under.name].kv_cache_dtypes:
        pytest.skip(f"{under.name} has no int8 cache")
    if not under.supports(dtype):
        pytest.skip(f"{under.name} does not compute in {dtype}")
    spec = make_spec(6, 2, 40, dtype, kv_cache_dtype="int8")  # head_dim 40: padded lanes; GQA 3
    rows = [(40, 1), (0, 17), (33, 5), (97, 1), (3, 2)]
    case = make_case(rows, spec, block_size=under.block_size, device=under.device, seed=6, pad_to=6)
    assert case.layer.key.dtype == torch.int8 and case.layer.k_scale is not None
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    before = case.storage.clone()
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    expect = _int8_rows_written(case, before, case.meta.slot_mapping)
    assert torch.equal(case.storage, expect), "the write differs from the reference quantization"
    out = backend.attend(case.query, case.layer, plan)
    _check(out[: case.meta.num_real_tokens], reference_output(case), int8_output_dtype(dtype))


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_int8_cache_refuses_a_layer_laid_out_otherwise(under: UnderTest) -> None:
    """The kernels address an int8 block's scales right after its values: a layer whose
    tensors are laid out any other way is refused by name before anything is written."""
    if "int8" not in BACKENDS[under.name].kv_cache_dtypes:
        pytest.skip(f"{under.name} has no int8 cache")
    spec = make_spec(4, 2, 16, torch.float16, kv_cache_dtype="int8")
    case = make_case([(3, 2)], spec, block_size=under.block_size, device=under.device)
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    layer = case.layer
    assert layer.k_scale is not None
    apart = dataclasses.replace(layer, k_scale=layer.k_scale.clone())  # scales outside the blocks
    flat = dataclasses.replace(layer, key=layer.key.contiguous())
    wide = dataclasses.replace(layer, v_scale=layer.k_scale.float())
    before = case.storage.clone()
    for bad, field_name in ((apart, "k_scale"), (flat, "key"), (wide, "v_scale")):
        with pytest.raises(UnsupportedSettingError, match=rf"layer\.{field_name}"):
            backend.write_kv(case.new_key, case.new_value, bad, plan)
    assert torch.equal(case.storage, before), "a refused call wrote to the cache"


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_token_major_values_of_a_16bit_cache(under: UnderTest) -> None:
    """A 16-bit cache handed over with V token-major (``attention.value_layout``): read right,
    and the NaN poison in the slots past each row's end, which the kernels read unmasked
    inside valid blocks, stays out of the output. (kvcache stores only 8-bit V this way; an
    fp16 V shows the NaN under the CPU interpreter too, which turns an fp8 NaN finite.)"""
    spec = make_spec(8, 2, 64, torch.float16)
    if under.name == "flash_attn":  # reads contiguous caches only: refused, by name
        with pytest.raises(UnsupportedSettingError, match=r"layer\.value: token-major"):
            _run(under, [(40, 1)], spec, token_major_values=True)
        return
    windowed = make_spec(8, 2, 64, torch.float16, sliding_window=40)
    # prefill, decode, and prefill past a sliding window (its partly-outside tiles)
    for s, rows in ((spec, [(0, 17), (0, 70)]), (spec, [(40, 1), (33, 5), (97, 1)]), (windowed, [(0, 150), (90, 33)])):
        out, ref, case = _run(under, rows, s, seed=5, token_major_values=True)
        assert is_token_major(case.layer.value)
        _check(out, ref, torch.float16)


# ---- GPU-sized cases (CUDA only) -----------------------------------------------------------

_CUDA = [p for p in BACKENDS_UNDER_TEST if p.values[0].device == "cuda"]
CUDA_BACKENDS = _CUDA or [pytest.param(None, id="no-cuda", marks=pytest.mark.skip(reason="needs a CUDA device"))]
gpu = pytest.mark.gpu

DECODE = [(c, 1) for c in (0, 1, 31, 255, 256, 257, 1000, 2047, 3001, 4095, 8191)]
MIXED = [(0, 1), (0, 31), (0, 97), (255, 1), (256, 1), (257, 1), (600, 33), (1000, 1), (0, 513), (31, 300)]
LONG_PROMPTS = [(0, 2048), (0, 1000), (1500, 700)]
GPU_ROWS = [
    pytest.param(DECODE, id="decode"),
    pytest.param(MIXED, id="mixed"),
    pytest.param(LONG_PROMPTS, id="long-prompts"),
]

# (dtype, GQA group, head_dim, block): every combination at the backend's smallest block size;
# at a large one (256 for reference and triton, 512 for flash_attn), a subset that still covers
# every value of each axis.
GPU_SHAPES = [
    pytest.param(dtype, group, head_dim, "smallest", id=f"{str(dtype)[6:]}-g{group}-d{head_dim}-smallest-block")
    for dtype in (torch.bfloat16, torch.float16)
    for group in (1, 4, 8)
    for head_dim in (64, 128, 256)
] + [
    pytest.param(dtype, group, head_dim, "large", id=f"{str(dtype)[6:]}-g{group}-d{head_dim}-large-block")
    for dtype, group, head_dim in (
        (torch.bfloat16, 1, 128),
        (torch.bfloat16, 4, 128),
        (torch.bfloat16, 8, 128),
        (torch.float16, 4, 64),
        (torch.bfloat16, 4, 256),
        (torch.float16, 8, 256),
    )
]


def _gpu_run(under: UnderTest, rows: list[tuple[int, int]], spec: AttentionSpec, block_size: int, seed: int) -> None:
    out, ref, _ = _run(under, rows, spec, block_size=block_size, seed=seed)
    dtype = getattr(torch, spec.dtype)
    assert rel_err(out, ref) < REL_TOLERANCE[dtype]


@gpu
@pytest.mark.parametrize("under", CUDA_BACKENDS)
@pytest.mark.parametrize(("dtype", "group", "head_dim", "block"), GPU_SHAPES)
@pytest.mark.parametrize("rows", GPU_ROWS)
def test_gpu_shapes(
    under: UnderTest, dtype: torch.dtype, group: int, head_dim: int, block: str, rows: list[tuple[int, int]]
) -> None:
    block_size = under.block_size if block == "smallest" else max(256, 2 * under.block_size)
    spec = make_spec(2 * group, 2, head_dim, dtype)
    _gpu_run(under, rows, spec, block_size, seed=group * 1000 + head_dim)


@gpu
@pytest.mark.parametrize("under", CUDA_BACKENDS)
@pytest.mark.parametrize("rows", GPU_ROWS[:2])
def test_gpu_float32(under: UnderTest, rows: list[tuple[int, int]]) -> None:
    """fp32 caches use exact fp32 dot products (not tf32)."""
    if not under.supports(torch.float32):
        pytest.skip(f"{under.name} does not compute in float32")
    _gpu_run(under, rows, make_spec(8, 2, 128, torch.float32), under.block_size, seed=0)


@gpu
@pytest.mark.parametrize("under", CUDA_BACKENDS)
@pytest.mark.parametrize("head_dim", [40, 96, 200])
@pytest.mark.parametrize("rows", GPU_ROWS[:2])
def test_gpu_padded_head_dims(under: UnderTest, head_dim: int, rows: list[tuple[int, int]]) -> None:
    """head_dims that are not powers of two (the kernels pad them to 64, 128, 256 lanes)."""
    block_size = max(64, under.block_size)
    _gpu_run(under, rows, make_spec(8, 2, head_dim, torch.bfloat16), block_size, seed=head_dim)


@gpu
@pytest.mark.parametrize("under", CUDA_BACKENDS)
@pytest.mark.parametrize(("dtype", "group", "head_dim"), [(torch.bfloat16, 4, 128), (torch.float16, 8, 64)])
@pytest.mark.parametrize("block", ["smallest", "large"])
@pytest.mark.parametrize("rows", GPU_ROWS)
def test_gpu_int8_cache(
    under: UnderTest, dtype: torch.dtype, group: int, head_dim: int, block: str, rows: list[tuple[int, int]]
) -> None:
    """The int8 cache at GPU sizes: long rows split over the sequence, prefill tiles, both
    block sizes; against the float64 oracle over the dequantized cache."""
    if "int8" not in BACKENDS[under.name].kv_cache_dtypes:
        pytest.skip(f"{under.name} has no int8 cache")
    block_size = under.block_size if block == "smallest" else max(256, 2 * under.block_size)
    spec = make_spec(2 * group, 2, head_dim, dtype, kv_cache_dtype="int8")
    out, ref, _ = _run(under, rows, spec, block_size=block_size, seed=group + head_dim)
    assert rel_err(out, ref) < REL_TOLERANCE[int8_output_dtype(dtype)]


@gpu
@pytest.mark.parametrize("under", CUDA_BACKENDS)
def test_cache_past_int32_offsets(under: UnderTest) -> None:
    """A layer cache of more than 2**31 elements, with the rows' blocks at its far end, so
    every address the kernels form (cache writes and reads) overflows int32."""
    block_size, kvh, d = 256, 8, 128
    spec = make_spec(4 * kvh, kvh, d, torch.bfloat16)
    small = make_case([(700, 1), (300, 1)], spec, block_size=block_size, device=under.device)
    num_blocks = (2**31) // (block_size * kvh * d) + 8
    used = small.layer.num_blocks
    shift = num_blocks - used  # block b of the small case lives at b + shift
    big = torch.empty((2, num_blocks, block_size, kvh, d), dtype=torch.bfloat16, device=under.device)
    assert big[0].numel() > 2**31
    big[:, shift:] = small.storage[:, 1:-1]
    layer = dataclasses.replace(small.layer, key=big[0], value=big[1])
    meta = small.meta
    meta = dataclasses.replace(
        meta,
        block_tables=torch.where(meta.block_tables >= 0, meta.block_tables + shift, meta.block_tables),
        slot_mapping=torch.where(meta.slot_mapping >= 0, meta.slot_mapping + shift * block_size, meta.slot_mapping),
    )
    expect = reference_output(small)
    backend = under.make(spec)
    plan = backend.plan(meta)
    backend.write_kv(small.new_key, small.new_value, layer, plan)
    out = backend.attend(small.query, layer, plan)
    assert rel_err(out, expect) < REL_TOLERANCE[torch.bfloat16]
    written = big.view(2, -1, kvh, d)[:, meta.slot_mapping]
    assert torch.equal(written[0], small.new_key) and torch.equal(written[1], small.new_value)
    del big, layer
    torch.cuda.empty_cache()


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("window", [None, 37], ids=["full", "window"])
def test_logit_softcap(under: UnderTest, window: int | None) -> None:
    """Scores capped at c * tanh(s / c) before the softmax (Gemma-2), in decode and prefill
    rows, with and without a window: the float64 oracle applies the cap, and a cap this small
    (2.0) changes the output, so a backend that ignored it would fail."""
    dtype = torch.float16
    rows = [(100, 1), (0, 50), (20, 30), (36, 1)]
    capped = make_spec(4, 2, 64, dtype, sliding_window=window, logit_softcap=2.0, softmax_scale=0.5)
    out, ref, _ = _run(under, rows, capped, seed=5)
    _check(out, ref, dtype)
    _, uncapped_ref, _ = _run(under, rows, dataclasses.replace(capped, logit_softcap=None), seed=5)
    assert rel_err(ref, uncapped_ref) > 0.05, "the cap should matter at these scores"


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("window", [None, 37], ids=["full", "window"])
def test_attention_sinks(under: UnderTest, window: int | None) -> None:
    """Learned per-head sink logits in the denominator, in decode rows (short and long:
    one chunk and split ones, merged) and prefill rows: against the float64 oracle; the sinks
    are large enough to matter. A backend without them refuses the spec at construction."""
    dtype = torch.float16
    spec = make_spec(4, 2, 64, dtype, sliding_window=window, attention_sinks=True)
    if not BACKENDS[under.name].attention_sinks:
        with pytest.raises(UnsupportedSettingError, match="attention_sinks"):
            under.make(spec)
        return
    rows = [(700, 1), (0, 50), (20, 30), (36, 1)]
    sinks = torch.tensor([1.0, -0.5, 2.5, 0.0], device=under.device)
    case = make_case(rows, spec, block_size=under.block_size, device=under.device, seed=6)
    backend = under.make(spec)
    ref = _sink_reference(case, sinks)
    variants = [backend]
    if under.name == "triton":  # split rows, merged by the combine kernel or in the decode kernel
        config = backend.decode_config  # type: ignore[attr-defined]
        variants = [
            type(backend)(spec, decode_chunk_len=128, decode_config=dataclasses.replace(config, fused_combine=fused))
            for fused in (False, True)
        ]
    for backend in variants:
        plan = backend.plan(case.meta)
        backend.write_kv(case.new_key, case.new_value, case.layer, plan)
        out = backend.attend(case.query, case.layer, plan, sinks=sinks)[: case.meta.num_real_tokens]
        _check(out, ref, dtype)
    no_sinks = dataclasses.replace(case, spec=dataclasses.replace(spec, attention_sinks=False))
    assert rel_err(ref, reference_output(no_sinks)) > 0.05, "the sinks should matter"
    with pytest.raises(InvalidArgumentError, match="sinks: the spec has attention_sinks"):
        backend.attend(case.query, case.layer, plan)
    with pytest.raises(InvalidArgumentError, match="sinks"):
        backend.attend(case.query, case.layer, plan, sinks=sinks[:2])


def _sink_reference(case: PagedCase, sinks: torch.Tensor) -> torch.Tensor:
    """reference_output with the sinks: the float64 oracle over the written cache."""
    from attention import LayerCache, ReferenceBackend

    spec32 = dataclasses.replace(case.spec, dtype="float32", kv_cache_dtype=None)
    oracle = ReferenceBackend(spec32, compute_dtype=torch.float64)
    layer = case.layer
    written = LayerCache(layer.key.clone(), layer.value.clone(), layer.index)
    writer = ReferenceBackend(case.spec)
    writer.write_kv(case.new_key, case.new_value, written, writer.plan(case.meta))
    plain = LayerCache(written.key.float(), written.value.float(), layer.index)
    out = oracle.attend(case.query.float(), plain, oracle.plan(case.meta), sinks=sinks.float())
    return out[: case.meta.num_real_tokens]
