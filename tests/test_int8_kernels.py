"""The Triton kernels over an int8 cache with a scale per (token, KV head)
(:mod:`attention.token_scales`): the cache writes bit for bit against the reference's
quantization, and decode and prefill through the triton backend against a float64 oracle over
the dequantized cache.

Without a GPU this runs in Triton's CPU interpreter (tests/conftest.py), on small shapes.
Caches come from tests/paged_case.py: shuffled block ids, every byte no write touched 0x7E
(whose fp16 scales read as NaN), a guard block at each end, so a kernel that reads a scale or
a value it must not turns the output NaN. head_dim 16 and 24 (24 pads to 32 lanes), block
sizes 32, 64 and 96 (96: tiles span blocks), GQA 2 and 3.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention import AttentionSpec, LayerCache, ReferenceBackend
from attention.quantize import dequantize
from attention.reference import scatter_kv
from attention.rotary import RotaryTable, rotate
from attention.staging import StepCapacity
from attention.token_scales import quantize_rows
from attention.triton_backend import TritonBackend, TritonStepPlan
from attention.triton_kernels import DecodeConfig, default_decode_config, rotary_write_kv, write_kv_cache
from tests.paged_case import TOLERANCE, PagedCase, int8_layer, int8_output_dtype, int8_views, make_case, make_spec

pytestmark = pytest.mark.kernel

#: (heads, kv_heads, head_dim, block_size, dtype): GQA 2 and 3, padded lanes, tiles inside a
#: block and tiles across blocks, every compute dtype.
SHAPES = [
    pytest.param(4, 2, 16, 32, torch.float16, id="gqa2-d16-bs32-fp16"),
    pytest.param(3, 1, 24, 96, torch.bfloat16, id="gqa3-d24-bs96-bf16"),
    pytest.param(4, 2, 24, 64, torch.float32, id="gqa2-d24-bs64-fp32"),
]


def _spec(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, **kw: object) -> AttentionSpec:
    return make_spec(heads, kv_heads, head_dim, dtype, kv_cache_dtype="int8", **kw)


def _spiky(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows of very different magnitudes (so every row gets its own scale), with a
    row of zeros (scale 0), a row past 127 * 65504 (the scale saturates) and a row so small
    its scale is an fp16 subnormal."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen) * 2)
    x[0, 0] = 0.0
    if dtype != torch.float16:  # fp16 inputs cannot exceed 65504
        x[1, -1] *= 1e7 / x[1, -1].abs().max()
    x[2, 0] *= 1e-6 / x[2, 0].abs().max()
    return x.to(dtype)


WRITE_SHAPES = [
    pytest.param(3, 16, 32, id="kvh3-d16-bs32"),
    pytest.param(2, 24, 96, id="kvh2-d24-bs96"),
    pytest.param(5, 24, 64, id="kvh5-d24-bs64"),  # 5 heads: a head chunk with padded head lanes
]


@pytest.mark.parametrize(("kv_heads", "head_dim", "block_size"), WRITE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True], ids=["write", "rotary-write"])
def test_writes_match_the_reference_bit_for_bit(
    kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, fused: bool, triton_device: str
) -> None:
    """write_kv_cache and rotary_write_kv store exactly the bytes scatter_kv stores (values and
    fp16 scales, after rotation for the fused kernel) and leave every other byte -- other
    slots, scale padding, the guard blocks -- as it was; a slot of -1 or outside the cache
    writes nothing."""
    blocks, tokens = 4, 9
    dev = triton_device
    key = _spiky((tokens, kv_heads, head_dim), dtype, seed=head_dim).to(dev)
    value = _spiky((tokens, kv_heads, head_dim), dtype, seed=head_dim + 1).to(dev)
    n_slots = blocks * block_size
    slots = torch.tensor([5, -1, n_slots - 1, 3, block_size, n_slots, 2 * block_size + 7, 1, block_size - 1])
    slots = slots.to(dev)
    got, layer = int8_layer(blocks, block_size, kv_heads, head_dim, dev)
    want = got.clone()
    oracle = int8_views(want, block_size)
    kept = torch.where(slots < n_slots, slots, -1)  # the reference refuses an id outside the cache
    if fused:
        table = RotaryTable.build(1.0 / 500.0 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim), 300)
        positions = torch.tensor([3, 0, 7, 100, 5, 9, 2, 299, 40], device=dev)
        query = torch.randn(tokens, 2 * kv_heads, head_dim).to(dtype=dtype, device=dev)
        rotary_write_kv(
            query, key, value, layer.key, layer.value, slots, positions, table.cos_sin, layer.k_scale, layer.v_scale
        )
        scatter_kv(rotate(key, positions, table), value, oracle, kept)
    else:
        write_kv_cache(key, value, layer.key, layer.value, slots, layer.k_scale, layer.v_scale)
        scatter_kv(key, value, oracle, kept)
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ from the reference's"
    assert layer.k_scale is not None and layer.v_scale is not None
    assert not layer.k_scale.flatten(0, 1)[kept[kept >= 0]].isnan().any(), "a written scale is missing"


def test_write_rounds_like_the_reference_at_ties(triton_device: str) -> None:
    """Values that land exactly on x.5 after the division round away from zero, and the
    division is the correctly rounded one: a row whose scale is 1 (max 127) and whose values
    are k + 0.5 stores k + 1 (-k - 1 for negatives)."""
    d, kvh, bs = 16, 1, 32
    row = torch.tensor([127.0, -0.5, 0.5, 1.5, -1.5, 2.5, 63.5, -63.5, 126.5, 0.25, 0.75, -0.75, 3.0, 0.0, -127, 1])
    key = row.view(1, kvh, d).to(triton_device)
    _, layer = int8_layer(1, bs, kvh, d, triton_device)
    write_kv_cache(
        key, key, layer.key, layer.value, torch.tensor([0], device=triton_device), layer.k_scale, layer.v_scale
    )
    q, scale = quantize_rows(key)
    assert scale.item() == 1.0
    assert torch.equal(layer.key[0, 0], q[0]) and torch.equal(layer.value[0, 0], q[0])
    assert layer.key[0, 0, 0, :9].tolist() == [127, -1, 1, 2, -2, 3, 64, -64, 127]


def _oracle(case: PagedCase, layer: LayerCache, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention of the case's real tokens over ``layer`` (already written) dequantized
    to float32, [num_real_tokens, heads, d]."""
    spec64 = dataclasses.replace(case.spec, dtype="float32", kv_cache_dtype=None)
    oracle = ReferenceBackend(spec64, compute_dtype=torch.float64)
    plain = LayerCache(
        dequantize(layer.key, layer.k_scale, torch.float32),
        dequantize(layer.value, layer.v_scale, torch.float32),
        layer.index,
    )
    out = oracle.attend(case.query.float(), plain, oracle.plan(case.meta), sinks=sinks)
    return out[: case.meta.num_real_tokens]


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "NaN in the output: a kernel read an unwritten value or scale"
    # The oracle reads the same int8 values and scales, so what is left is the kernels' own
    # rounding (paged_case.TOLERANCE): P and the output rounded once each, P in bf16 for
    # 16-bit queries (paged_case.int8_output_dtype).
    torch.testing.assert_close(out.double(), ref.double(), **TOLERANCE[int8_output_dtype(dtype)])


def _write_and_attend(
    backend: TritonBackend, case: PagedCase, sinks: torch.Tensor | None = None, graph: bool = False
) -> tuple[torch.Tensor, TritonStepPlan]:
    plan = backend.plan(case.meta, graph=graph)
    assert isinstance(plan, TritonStepPlan)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    return backend.attend(case.query, case.layer, plan, sinks=sinks), plan


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "dtype"), SHAPES)
def test_mixed_prefill_and_decode_rows(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, triton_device: str
) -> None:
    """Prefill rows (with and without cached context), one-token rows and rows of several
    new tokens (the decode kernel's multi-token path) in one step, odd lengths and partial
    last blocks, against the float64 oracle."""
    spec = _spec(heads, kv_heads, head_dim, dtype)
    rows = [(0, 1), (block_size - 1, 1), (0, 33), (block_size + 1, 1), (40, 3), (5, 17), (2 * block_size + 3, 1)]
    case = make_case(rows, spec, block_size=block_size, device=triton_device, seed=head_dim, pad_to=len(rows) + 1)
    backend = TritonBackend(spec)
    out, plan = _write_and_attend(backend, case)
    assert plan.decode_rows and plan.prefill_rows, "the step should run both kernels"
    _check(out[: case.meta.num_real_tokens], _oracle(case, case.layer), dtype)


@pytest.mark.parametrize("fused", [False, True], ids=["combine-kernel", "fused-combine"])
@pytest.mark.parametrize(("block_size", "head_dim"), [(32, 16), (96, 24)])
def test_long_rows_split_across_chunks(fused: bool, block_size: int, head_dim: int, triton_device: str) -> None:
    """Rows spanning many blocks, cut into chunks of 32 tokens: each chunk's partial and the
    merge (a combine kernel, or fused into the last chunk program) read the right scales."""
    spec = _spec(4, 2, head_dim, torch.float16)
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16, fused_combine=fused), decode_chunk_len=32)
    rows = [(300, 1), (7, 1), (150, 2)]
    case = make_case(rows, spec, block_size=block_size, device=triton_device, seed=block_size)
    out, plan = _write_and_attend(backend, case)
    assert plan.decode[0].schedule.needs_combine, "the long rows should be split"
    _check(out, _oracle(case, case.layer), torch.float16)


def test_sliding_window_sinks_and_softcap(triton_device: str) -> None:
    """A sliding window shorter than the rows (its partly-outside tiles and blocks the window
    left, whose scales are never read), learned sinks and a logit cap, on both kernels."""
    spec = _spec(6, 2, 24, torch.bfloat16, sliding_window=40, attention_sinks=True, logit_softcap=2.5)
    rows = [(100, 1), (0, 70), (61, 33), (39, 1), (150, 4)]
    case = make_case(rows, spec, block_size=32, device=triton_device, seed=3)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(1)).to(triton_device)
    out, plan = _write_and_attend(TritonBackend(spec), case, sinks)
    assert plan.decode_rows and plan.prefill_rows
    _check(out, _oracle(case, case.layer, sinks), torch.bfloat16)


def test_stale_blocks_below_the_window_stay_unread(triton_device: str) -> None:
    """Blocks wholly below every query's window may have been released: here they are
    re-poisoned (values and scales 0x7E, NaN scales) after the context was written, and the
    output must not change."""
    spec = _spec(4, 2, 16, torch.float16, sliding_window=33)
    rows = [(200, 1), (130, 40)]
    case = make_case(rows, spec, block_size=32, device=triton_device, seed=5)
    backend = TritonBackend(spec)
    out, _ = _write_and_attend(backend, case)
    for r, (context, _) in enumerate(rows):
        first_seen = context + 1 - 33  # the row's first new token sees from here on
        for col in range(first_seen // 32):
            block = int(case.meta.block_tables[r, col])
            case.storage[:, block + 1] = 0x7E
    again = backend.attend(case.query, case.layer, backend.plan(case.meta))
    assert torch.equal(out, again), "a block below the window was read"
    _check(out, _oracle(case, case.layer), torch.float16)


def test_graph_steps_on_fixed_grids(triton_device: str) -> None:
    """A CUDA-graph plan (fixed decode grid and persistent prefill programs over a padded
    tile index) reads an int8 cache like an eager one."""
    spec = _spec(4, 2, 16, torch.float16)
    backend = TritonBackend(spec, decode_config=DecodeConfig(block_n=16), num_sms=8)
    rows = [(3, 1), (0, 37), (90, 1), (12, 5)]
    case = make_case(rows, spec, block_size=32, device=triton_device, pad_to=6, pad_tokens=64, seed=2)
    out, plan = _write_and_attend(backend, case, graph=True)
    assert plan.prefill is not None and plan.prefill.programs is not None
    _check(out[: case.meta.num_real_tokens], _oracle(case, case.layer), torch.float16)


def test_scales_are_applied(triton_device: str) -> None:
    """The kernels read the scales, not just the int8 values: doubling every stored K scale of
    one head's tokens changes the output as the oracle says (and the oracle's output with
    the old scales no longer matches)."""
    spec = _spec(2, 1, 16, torch.float32)
    rows = [(50, 1), (0, 20)]
    case = make_case(rows, spec, block_size=32, device=triton_device, seed=9)
    backend = TritonBackend(spec)
    before, plan = _write_and_attend(backend, case)
    assert case.layer.k_scale is not None and case.layer.v_scale is not None
    case.layer.k_scale.mul_(2.0)
    case.layer.v_scale.mul_(0.5)
    after = backend.attend(case.query, case.layer, plan)
    _check(after, _oracle(case, case.layer), torch.float32)
    assert not torch.allclose(before, after, atol=1e-3), "the scales made no difference"


def test_decode_config_for_an_int8_cache() -> None:
    """An int8 cache has fp8's bytes per token: the same tiles and pipeline depth (not fp8's
    wave fill at block 32, which lost 10% on int8 at 64 x 4096)."""
    fp8 = default_decode_config(128, torch.bfloat16, torch.float8_e4m3fn)
    int8 = default_decode_config(128, torch.bfloat16, torch.int8)
    assert int8 == dataclasses.replace(fp8, wave_fill=None) and int8.num_stages == 3 and fp8.wave_fill == 0.9
    assert TritonBackend(_spec(8, 2, 128, torch.bfloat16)).decode_config == int8


def test_warmup_compiles_every_int8_variant(triton_device: str) -> None:
    """Warm-up runs the writes, decode and prefill kernels over a scratch int8 cache."""
    spec = _spec(2, 1, 16, torch.float16)
    capacity = StepCapacity(max_rows=2, max_tokens=20, max_blocks_per_seq=3)
    assert TritonBackend(spec).warmup(32, capacity, torch.device(triton_device)) > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiny_values_keep_their_precision_with_fp16_queries(dtype: torch.dtype, triton_device: str) -> None:
    """V of magnitude 1e-4 has scales near 1e-6: P times them would fall into fp16's
    subnormals (whose steps are 6e-8); the kernels take that product in bf16 even for fp16
    queries (paging.int8_values), so decode and prefill stay as close to the oracle, relative
    to the output's size, as for values of magnitude 1."""
    spec = _spec(4, 2, 16, dtype)
    rows = [(70, 1), (0, 40), (33, 5)]
    case = make_case(rows, spec, block_size=32, device=triton_device, seed=3)
    # Every cached value rewritten at 1e-4 of its size (the context through the reference write).
    bs, start = 32, 0
    for row, (context, new) in enumerate(rows):
        pos = torch.arange(context, device=triton_device)
        slots = case.meta.block_tables[row, pos // bs].long() * bs + pos % bs
        ctx = slice(start, start + context)
        scatter_kv(case.all_key[ctx], case.all_value[ctx] * 1e-4, case.layer, slots)
        start += context + new
    tiny = dataclasses.replace(case, new_value=case.new_value * 1e-4)
    out, _ = _write_and_attend(TritonBackend(spec), tiny)
    ref = _oracle(tiny, tiny.layer)
    size = ref.abs().max()
    assert size < 1e-3, "the values should be tiny"
    _check(out[: tiny.meta.num_real_tokens] / size, ref / size, dtype)
