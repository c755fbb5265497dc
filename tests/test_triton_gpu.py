"""The triton backend on a CUDA GPU: larger shapes, 16-bit dtypes, forced decode chunk lengths,
every launch configuration the benchmark sweeps, and caches past 2**31 elements.

Skipped without a CUDA device (the interpreter tests in test_triton_interpret.py cover the
same kernels on CPU with small shapes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention import get_backend
from attention.triton_backend import TritonBackend, TritonStepPlan
from attention.triton_kernels import (
    DECODE_SWEEP,
    PREFILL_SWEEP,
    DecodeConfig,
    DecodeSchedule,
    PrefillConfig,
    allocate_decode_workspace,
    decode_metadata,
    max_decode_items,
    max_decode_partials,
    paged_decode,
    schedule_decode,
)
from tests.paged_case import PagedCase, make_case, reference_output, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Norm-relative error against the float64 reference on the same rounded inputs. bf16 keeps 8
# mantissa bits (P and the output are rounded to it: ~4e-3 relative each); fp16 keeps 11.
# fp32 runs its products as "tf32x3" (~2^-21 each) with approximate exp2: ~1e-6.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-5}

DECODE = [(c, 1) for c in (0, 1, 31, 255, 256, 257, 1000, 2047, 4095, 8191)]
MIXED = [
    (0, 1),
    (0, 31),
    (0, 97),
    (255, 1),
    (256, 1),
    (257, 1),
    (600, 33),
    (1000, 1),
    (0, 513),
    (31, 300),
]
LONG_PROMPTS = [(0, 2048), (0, 1000), (1500, 700)]


def _fresh_new_tokens(case: PagedCase) -> None:
    kvh, d = case.k_cache.shape[2:]
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, kvh, d)[case.meta.slot_mapping] = float("nan")


def _attend(backend: TritonBackend, case: PagedCase) -> torch.Tensor:
    _fresh_new_tokens(case)
    backend.write_kv(case.new_key, case.new_value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    return backend.attend(case.query, case.k_cache, case.v_cache, backend.plan(case.meta))


def _case(
    rows: list[tuple[int, int]],
    *,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_heads: int = 2,
    seed: int = 0,
) -> PagedCase:
    return make_case(
        rows,
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=seed,
    )


# (dtype, GQA group, head_dim): each combination is a separate compiled kernel, so the grid
# covers every value of each axis without the full product (compile time dominates).
SHAPES = [
    pytest.param(torch.bfloat16, 1, 128, id="bf16-g1-d128"),
    pytest.param(torch.bfloat16, 4, 128, id="bf16-g4-d128"),
    pytest.param(torch.bfloat16, 8, 128, id="bf16-g8-d128"),
    pytest.param(torch.float16, 4, 64, id="fp16-g4-d64"),
    pytest.param(torch.bfloat16, 4, 256, id="bf16-g4-d256"),
    pytest.param(torch.float16, 8, 256, id="fp16-g8-d256"),
]


@pytest.mark.parametrize(("dtype", "group", "head_dim"), SHAPES)
@pytest.mark.parametrize("block_size", [32, 256])
@pytest.mark.parametrize("chunk_len", [None, 10**6, 256, 64])
def test_decode(dtype: torch.dtype, group: int, head_dim: int, block_size: int, chunk_len: int | None) -> None:
    case = _case(
        DECODE,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=group * 1000 + head_dim,
    )
    backend = TritonBackend(decode_chunk_len=chunk_len)
    out = _attend(backend, case)
    assert rel_err(out, reference_output(case)) < TOLERANCE[dtype]


@pytest.mark.parametrize(("dtype", "group", "head_dim"), SHAPES)
@pytest.mark.parametrize("block_size", [32, 256])
@pytest.mark.parametrize("rows", [MIXED, LONG_PROMPTS], ids=["mixed", "long"])
def test_prefill(dtype: torch.dtype, group: int, head_dim: int, block_size: int, rows: list[tuple[int, int]]) -> None:
    case = _case(
        rows,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=group + head_dim,
    )
    out = _attend(TritonBackend(), case)
    assert rel_err(out, reference_output(case)) < TOLERANCE[dtype]


@pytest.mark.parametrize("chunk_len", [10**6, 256, 64])
def test_mixed_batch_decode_rows_split(chunk_len: int) -> None:
    """The one-token rows of a mixed step run chunked, naming their table rows and tokens."""
    case = _case(MIXED, group=4, head_dim=128, block_size=32, dtype=torch.bfloat16)
    backend = TritonBackend(decode_chunk_len=chunk_len)
    plan = backend.plan(case.meta)
    assert isinstance(plan, TritonStepPlan) and plan.decode_rows and plan.prefill_rows
    out = _attend(backend, case)
    assert rel_err(out, reference_output(case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("head_dim", [40, 96, 200])
@pytest.mark.parametrize("rows", [DECODE, MIXED], ids=["decode", "mixed"])
def test_padded_head_dims(head_dim: int, rows: list[tuple[int, int]]) -> None:
    case = _case(rows, group=4, head_dim=head_dim, block_size=64, dtype=torch.bfloat16)
    out = _attend(TritonBackend(), case)
    assert rel_err(out, reference_output(case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rows", [DECODE, MIXED], ids=["decode", "mixed"])
def test_float32(rows: list[tuple[int, int]]) -> None:
    """fp32 caches use exact fp32 dot products (not tf32)."""
    case = _case(rows, group=4, head_dim=128, block_size=32, dtype=torch.float32)
    out = _attend(TritonBackend(), case)
    assert rel_err(out, reference_output(case)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("config", DECODE_SWEEP, ids=str)
@pytest.mark.parametrize("block_size", [32, 256])
def test_every_decode_sweep_config(config: DecodeConfig, block_size: int) -> None:
    """Each configuration the benchmark sweep may pick compiles and is correct (bf16, GQA 4,
    d 128, the benchmark's shape)."""
    case = _case(DECODE, group=4, head_dim=128, block_size=block_size, dtype=torch.bfloat16)
    out = _attend(TritonBackend(decode_config=config, decode_chunk_len=256), case)
    assert rel_err(out, reference_output(case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("config", PREFILL_SWEEP, ids=str)
@pytest.mark.parametrize("block_size", [32, 256])
def test_every_prefill_sweep_config(config: PrefillConfig, block_size: int) -> None:
    case = _case(MIXED, group=4, head_dim=128, block_size=block_size, dtype=torch.bfloat16)
    out = _attend(TritonBackend(prefill_config=config), case)
    assert rel_err(out, reference_output(case)) < TOLERANCE[torch.bfloat16]


def test_cache_past_int32_offsets() -> None:
    """A layer cache of more than 2**31 elements, with the rows' blocks at its far end, so
    every address the kernels form overflows int32."""
    block_size, kvh, d = 256, 8, 128
    per_block = block_size * kvh * d
    num_blocks = (2**31) // per_block + 8
    small = _case(
        [(700, 1), (300, 1)],
        group=4,
        head_dim=d,
        block_size=block_size,
        dtype=torch.bfloat16,
        kv_heads=kvh,
    )
    used = small.k_cache.shape[0]
    k_cache = torch.empty((num_blocks, block_size, kvh, d), dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    assert k_cache.numel() > 2**31
    k_cache[-used:] = small.k_cache  # block b of the small case lives at num_blocks - used + b
    v_cache[-used:] = small.v_cache
    shift = num_blocks - used
    meta = small.meta
    tables = torch.where(meta.block_tables >= 0, meta.block_tables + shift, meta.block_tables)
    slot_shift = shift * block_size
    big = dataclasses.replace(
        small,
        k_cache=k_cache,
        v_cache=v_cache,
        meta=dataclasses.replace(meta, block_tables=tables, slot_mapping=meta.slot_mapping + slot_shift),
    )
    expect = reference_output(small)
    backend = TritonBackend(decode_chunk_len=256)
    out = _attend(backend, big)
    assert rel_err(out, expect) < TOLERANCE[torch.bfloat16]
    del k_cache, v_cache, big
    torch.cuda.empty_cache()


def test_registry_and_plan_on_gpu() -> None:
    backend = get_backend("triton")
    case = _case([(4000, 1)], group=4, head_dim=128, block_size=32, dtype=torch.bfloat16)
    plan = backend.plan(case.meta)
    assert isinstance(plan, TritonStepPlan) and plan.use_decode
    assert plan.num_sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert plan.decode_schedule(2, 64).num_items > 1  # one row, two KV heads: split to fill the GPU


def test_write_kv_exact_and_nothing_else() -> None:
    backend = TritonBackend()
    k = torch.full((5, 32, 4, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    v = k.clone()
    slots = torch.tensor([5, -1, 100, 32, 159, -1], device="cuda")
    key = torch.randn(6, 4, 128, dtype=torch.bfloat16, device="cuda")
    value = torch.randn(6, 4, 128, dtype=torch.bfloat16, device="cuda")
    expect_k, expect_v = k.clone(), v.clone()
    keep = slots >= 0
    expect_k.view(-1, 4, 128)[slots[keep]] = key[keep]
    expect_v.view(-1, 4, 128)[slots[keep]] = value[keep]
    backend.write_kv(key, value, k, v, slots)
    assert torch.equal(k.view(torch.int16), expect_k.view(torch.int16))
    assert torch.equal(v.view(torch.int16), expect_v.view(torch.int16))


def _rows_reference(case: PagedCase, table_rows: list[int], q_tokens: list[int], scale: float) -> torch.Tensor:
    """float64 [rows, heads, d]: query token q_tokens[i] over all of table row table_rows[i]."""
    bs, kvh, d = case.k_cache.shape[1:]
    heads = case.query.shape[1]
    outs = []
    for row, token in zip(table_rows, q_tokens, strict=True):
        pos = torch.arange(case.meta.seq_lens_host[row], device="cuda")
        slots = case.meta.block_tables[row, pos // bs].long() * bs + pos % bs
        k = case.k_cache.view(-1, kvh, d)[slots].double().repeat_interleave(heads // kvh, dim=1)
        v = case.v_cache.view(-1, kvh, d)[slots].double().repeat_interleave(heads // kvh, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", case.query[token].double(), k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


@pytest.mark.parametrize("fused", [False, True], ids=["combine-kernel", "fused-combine"])
def test_decode_graph_replays_later_steps_on_a_fixed_grid(fused: bool) -> None:
    """Capture one decode launch for a bucket of 8 rows, then replay it for steps with other
    rows, lengths and chunkings: only the persistent metadata buffers change (a graph's
    launches keep their grid and arguments). Fused counters are back at 0 after each."""
    case = _case([(c, 1) for c in (4095, 30, 700, 2047, 1, 9000, 256, 5000)], group=4, head_dim=128, block_size=32,
                 dtype=torch.bfloat16)  # fmt: skip
    kvh, heads, d = 2, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bucket, config = 8, DecodeConfig(block_n=64, fused_combine=fused)
    cap_items = max_decode_items(bucket, kvh, sms)
    rows_buf = torch.zeros((bucket, 4), dtype=torch.int32, device="cuda")
    items_buf = torch.zeros((cap_items, 8), dtype=torch.int32, device="cuda")
    workspace = allocate_decode_workspace(
        max_rows=bucket,
        max_partials=max_decode_partials(bucket, kvh, sms),
        num_heads=heads,
        num_kv_heads=kvh,
        head_dim=d,
        device="cuda",
    )
    scale = d**-0.5
    lens = case.meta.seq_lens_host

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
        paged_decode(case.query, case.k_cache, case.v_cache, case.meta.block_tables, rows_buf, items_buf, first,
                     workspace, softmax_scale=scale, out=out, config=config)  # fmt: skip

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
        expect = _rows_reference(case, table_rows, list(range(n)), scale)
        assert rel_err(out[:n], expect) < TOLERANCE[torch.bfloat16], f"step {table_rows}"
        assert not out[n:].any(), "a token no row names was written"
        assert not workspace.counters.any()
