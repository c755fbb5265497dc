"""attention/triton_kernels/dequantize_blocks.py: the plan of which blocks an fp8 prefill step
copies at 16 bits (host), and the copy kernel (the Triton interpreter without a GPU, compiled
on one) against torch's dequantization of the same blocks, for contiguous and token-major V,
with block ids and table positions outside the cache mapped to block 0."""

from __future__ import annotations

import pytest
import torch

from attention.token_scales import dequantize_rows, quantized_layer
from attention.triton_kernels import kernels_interpreted
from attention.triton_kernels.dequantize_blocks import counted_programs, dequantize_blocks, plan_block_dequant
from attention.value_layout import token_major_view

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_plan_places_each_rows_blocks_in_turn() -> None:
    plan = plan_block_dequant([70, 5, 0, 33], rows=[0, 3, 2], block_size=32)
    assert (plan.num_blocks, plan.batch, plan.width) == (3 + 2 + 0, 4, 3)
    table = [list(plan.tables[r * 3 : r * 3 + 3]) for r in range(4)]
    assert table == [[0, 1, 2], [-1, -1, -1], [-1, -1, -1], [3, 4, -1]]
    assert list(plan.sources) == [0, 0, 0, 1, 0, 2, 3, 0, 3, 1]


def test_plan_of_no_blocks() -> None:
    plan = plan_block_dequant([0, 0], rows=[0, 1], block_size=128)
    assert plan.num_blocks == 0 and len(plan.sources) == 0 and list(plan.tables) == [-1, -1]


def test_plan_of_a_fixed_width() -> None:
    """A CUDA-graph step's table has the bucket's width whatever its rows read; a width too
    narrow for a row is refused."""
    plan = plan_block_dequant([70, 5, 0, 33], rows=[0, 3], block_size=32, width=5)
    assert (plan.num_blocks, plan.batch, plan.width) == (5, 4, 5)
    assert list(plan.tables[:5]) == [0, 1, 2, -1, -1] and list(plan.tables[15:]) == [3, 4, -1, -1, -1]
    with pytest.raises(ValueError, match="width: 2 columns cannot hold a row of 3 blocks"):
        plan_block_dequant([70, 5], rows=[0], block_size=32, width=2)


@pytest.mark.parametrize(("count", "programs"), [(5, 2), (0, 3), (9, None), (3, 1)])
def test_counted_copy_takes_the_first_count_sources(count: int, programs: int | None) -> None:
    """A CUDA-graph step's copy: a fixed grid of ``programs`` along the scratch blocks (fewer
    than the blocks, or as many) copies the first ``count`` sources, read on the device; a
    count past the scratch is clamped to it."""
    gen = torch.Generator().manual_seed(5)
    blocks, bs, kvh, d = 6, 32, 2, 32
    k8 = (torch.randn(blocks, bs, kvh, d, generator=gen) * 3).to(torch.float8_e4m3fn).to(DEVICE)
    v8 = token_major_view(torch.empty_like(k8)).copy_((torch.randn(blocks, bs, kvh, d, generator=gen) * 3).to(k8.dtype))
    scale = torch.ones(kvh, device=DEVICE)
    tables = torch.tensor([[3, 1, 5, 0], [2, 4, 0, 0]], dtype=torch.int32, device=DEVICE)
    sources = torch.tensor([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [-1, -1], [-1, -1], [-1, -1]],
                           dtype=torch.int32, device=DEVICE)  # fmt: skip
    counter = torch.tensor([count], dtype=torch.int32, device=DEVICE)
    key, value = dequantize_blocks(k8, v8, scale, scale, tables, sources, torch.float16, count=counter,
                                   programs=programs)  # fmt: skip
    assert key.shape == (8, bs, kvh, d)
    ids = [3, 1, 5, 2, 4, 0, 0, 0]
    for i in range(min(count, 8)):
        torch.testing.assert_close(key[i], k8[ids[i]].to(torch.float16), rtol=0.0, atol=0.0, msg=f"block {i}")
        torch.testing.assert_close(value[i], v8[ids[i]].to(torch.float16), rtol=0.0, atol=0.0, msg=f"block {i}")
    with pytest.raises(ValueError, match="count: expected one int32"):
        dequantize_blocks(k8, v8, scale, scale, tables, sources, torch.float16, count=counter.long())
    with pytest.raises(ValueError, match="programs: 0 must be >= 1"):
        dequantize_blocks(k8, v8, scale, scale, tables, sources, torch.float16, count=counter, programs=0)


@pytest.mark.parametrize(
    ("sms", "block_size", "kv_heads", "programs"),
    [(132, 256, 8, 9), (132, 32, 8, 66), (132, 256, 1, 66), (1, 256, 64, 1)],
)
def test_counted_copies_keep_about_four_programs_an_sm(sms: int, block_size: int, kv_heads: int, programs: int) -> None:
    """Each block takes kv_heads x ceil(block_size / 32) programs; never fewer than one along."""
    assert counted_programs(sms, block_size, kv_heads) == programs


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_matches_torch_dequantization(token_major: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    blocks, bs, kvh, d = 7, 32, 2, 48  # head_dim not a power of two: the padded lanes are masked
    k8 = (torch.randn(blocks, bs, kvh, d, generator=gen) * 3).to(torch.float8_e4m3fn).to(DEVICE)
    v_dense = (torch.randn(blocks, bs, kvh, d, generator=gen) * 3).to(torch.float8_e4m3fn).to(DEVICE)
    v8 = token_major_view(torch.empty_like(v_dense)).copy_(v_dense) if token_major else v_dense
    k_scale = (torch.rand(kvh, generator=gen) + 0.5).to(DEVICE)
    v_scale = (torch.rand(kvh, generator=gen) + 0.5).to(DEVICE)
    tables = torch.tensor([[4, 2, 6], [1, -3, 99]], dtype=torch.int32, device=DEVICE)
    # (row, column): in range, a negative id, an id past the cache, a column past the table.
    sources = torch.tensor([[0, 0], [0, 2], [1, 0], [1, 1], [1, 2], [0, 5], [7, 0]], dtype=torch.int32, device=DEVICE)
    key, value = dequantize_blocks(k8, v8, k_scale, v_scale, tables, sources, dtype)
    expect_ids = [4, 6, 1, 0, 0, 0, 0]
    # The interpreter keeps bf16 as raw bits and rounds float32 to it toward zero: one ulp.
    rtol = 2.0**-7 if kernels_interpreted() and dtype == torch.bfloat16 else 0.0
    for i, src in enumerate(expect_ids):
        k_ref = (k8[src].float() * k_scale[None, :, None]).to(dtype)
        v_ref = (v_dense[src].float() * v_scale[None, :, None]).to(dtype)
        torch.testing.assert_close(key[i], k_ref, rtol=rtol, atol=0.0, msg=f"K of scratch block {i}")
        torch.testing.assert_close(value[i], v_ref, rtol=rtol, atol=0.0, msg=f"V of scratch block {i}")
    assert key.is_contiguous() and value.is_contiguous() and key.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_copy_takes_each_tokens_scale(dtype: torch.dtype) -> None:
    """An int8 cache (values and per-token fp16 scales in each block, V token-major:
    attention.token_scales): every row comes out as its values times its own scale, rounded
    once to ``dtype``; ids outside the cache read block 0."""
    gen = torch.Generator().manual_seed(4)
    blocks, bs, kvh, d = 5, 32, 2, 64
    # Rows of very different ranges, so one scale per head could not give these values.
    key = torch.randn(blocks, bs, kvh, d, generator=gen) * torch.logspace(-2, 2, bs)[None, :, None, None]
    value = torch.randn(blocks, bs, kvh, d, generator=gen) * torch.logspace(2, -2, bs)[None, :, None, None]
    layer = quantized_layer(key.to(DEVICE), value.to(DEVICE))
    assert layer.k_scale is not None and layer.v_scale is not None
    tables = torch.tensor([[3, 0, 4], [2, 77, -1]], dtype=torch.int32, device=DEVICE)
    sources = torch.tensor([[0, 0], [0, 2], [1, 0], [1, 1], [0, 1]], dtype=torch.int32, device=DEVICE)
    k_out, v_out = dequantize_blocks(layer.key, layer.value, layer.k_scale, layer.v_scale, tables, sources, dtype)
    rtol = 2.0**-7 if kernels_interpreted() and dtype == torch.bfloat16 else 2.0**-24
    for i, src in enumerate([3, 4, 2, 0, 0]):
        for got, values, scales in ((k_out, layer.key, layer.k_scale), (v_out, layer.value, layer.v_scale)):
            want = dequantize_rows(values[src], scales[src], torch.float32).to(dtype)
            torch.testing.assert_close(got[i], want, rtol=rtol, atol=0.0, msg=f"scratch block {i}")
            assert got[i].float().abs().amax() > 0
    assert k_out.is_contiguous() and k_out.dtype == dtype
