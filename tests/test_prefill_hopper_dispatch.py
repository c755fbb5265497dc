"""Which route the triton backend picks for a layer's prefill rows (Hopper kernel over the
cache, over a dequantized copy, or the Triton kernel), decided on the host: checked here
without a GPU by declaring the device able to run the Hopper kernel. The kernels themselves
are tests/test_prefill_hopper.py's (GPU)."""

from __future__ import annotations

import pytest
import torch

import attention.triton_kernels.prefill_hopper as prefill_hopper
from attention import LayerCache
from attention.triton_backend import BlockDequant, PrefillLaunch, TritonBackend
from attention.triton_kernels import PrefillConfig
from tests.paged_case import make_spec

HEADS, KV_HEADS = 8, 2


@pytest.fixture(autouse=True)
def hopper_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_hopper, "hopper_prefill_possible", lambda device: True)


def _launch(block_m: int = 128, dequant: bool = False) -> PrefillLaunch:
    tiles = torch.zeros(1, 2, dtype=torch.int32)
    plan = BlockDequant(tiles, tiles) if dequant else None
    return PrefillLaunch(PrefillConfig(block_m=block_m, block_n=128), tiles, dequant=plan)


def _layer(dtype: torch.dtype, block_size: int = 256, head_dim: int = 128, scales: bool = False) -> LayerCache:
    key = torch.zeros(4, block_size, KV_HEADS, head_dim, dtype=dtype)
    value = torch.zeros_like(key)
    scale = torch.ones(KV_HEADS) if scales else None
    return LayerCache(key, value, k_scale=scale, v_scale=scale)


def _routes(backend: TritonBackend, layer: LayerCache, launch: PrefillLaunch, **kw: object) -> tuple[bool, bool]:
    d = layer.key.shape[-1]
    query = torch.zeros(300, HEADS, d, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    window = kw.get("window")
    args = (query, layer, out, launch, window, None)
    return backend._hopper_prefill_applies(*args), backend._dequant_prefill_applies(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [32, 64, 96, 128, 256, 384])
def test_a_bf16_cache_runs_on_the_hopper_kernel(block_size: int) -> None:
    backend = TritonBackend(make_spec(HEADS, KV_HEADS, 128, torch.bfloat16))
    assert _routes(backend, _layer(torch.bfloat16, block_size=block_size), _launch()) == (True, False)
    small = TritonBackend(make_spec(HEADS, KV_HEADS, 64, torch.bfloat16))
    assert _routes(small, _layer(torch.bfloat16, block_size=128, head_dim=64), _launch()) == (True, False)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ({"block_size": 16}, "blocks that are not a multiple of 32 (4 boxes a tile at most)"),
        ({"head_dim": 96}, "head_dim neither 64 nor 128"),
        ({"block_m": 64}, "a tile index of another height"),
        ({"window": 100}, "a sliding window"),
        ({"disabled": True}, "hopper_prefill=False"),
        ({"config": True}, "a fixed prefill_config"),
    ],
)
def test_the_triton_kernel_keeps_what_the_hopper_kernel_does_not_take(case: dict[str, object], why: str) -> None:
    d = int(case.get("head_dim", 128))  # type: ignore[call-overload]
    kw: dict[str, object] = {}
    if case.get("disabled"):
        kw["hopper_prefill"] = False
    if case.get("config"):
        kw["prefill_config"] = PrefillConfig()
    backend = TritonBackend(make_spec(HEADS, KV_HEADS, d, torch.bfloat16), **kw)  # type: ignore[arg-type]
    layer = _layer(torch.bfloat16, block_size=int(case.get("block_size", 256)), head_dim=d)  # type: ignore[call-overload]
    launch = _launch(block_m=int(case.get("block_m", 128)))  # type: ignore[call-overload]
    assert _routes(backend, layer, launch, window=case.get("window")) == (False, False), why


@pytest.mark.parametrize("block_size", [32, 256])
def test_an_fp8_cache_runs_on_the_copy_only_when_the_plan_made_one(block_size: int) -> None:
    spec = make_spec(HEADS, KV_HEADS, 128, torch.bfloat16, kv_cache_dtype="float8_e4m3")
    backend = TritonBackend(spec)
    layer = _layer(torch.float8_e4m3fn, block_size=block_size, scales=True)
    assert _routes(backend, layer, _launch(dequant=True)) == (False, True)
    assert _routes(backend, layer, _launch(dequant=False)) == (False, False)
    assert _routes(TritonBackend(spec, hopper_prefill=False), layer, _launch(dequant=True)) == (False, False)
    unscaled = _layer(torch.float8_e4m3fn)
    assert _routes(backend, unscaled, _launch(dequant=True)) == (False, False)


@pytest.mark.parametrize("block_size", [32, 256])
def test_an_int8_cache_runs_on_the_copy_only_when_the_plan_made_one(block_size: int) -> None:
    """An int8 cache (per-token scales stored in its blocks) takes the dequantized copy as fp8
    does; a layer without scales, or with K's and V's scales laid out differently, does not."""
    from attention.token_scales import quantized_layer

    spec = make_spec(HEADS, KV_HEADS, 128, torch.bfloat16, kv_cache_dtype="int8")
    backend = TritonBackend(spec)
    dense = torch.zeros(4, block_size, KV_HEADS, 128)
    layer = quantized_layer(dense, dense)
    assert _routes(backend, layer, _launch(dequant=True)) == (False, True)
    assert _routes(backend, layer, _launch(dequant=False)) == (False, False)
    assert _routes(TritonBackend(spec, hopper_prefill=False), layer, _launch(dequant=True)) == (False, False)
    assert layer.v_scale is not None
    unscaled = LayerCache(layer.key, layer.value)
    assert _routes(backend, unscaled, _launch(dequant=True)) == (False, False)
    apart = LayerCache(layer.key, layer.value, k_scale=layer.v_scale.contiguous(), v_scale=layer.v_scale)
    assert _routes(backend, apart, _launch(dequant=True)) == (False, False)


def test_which_outputs_take_the_tma_store() -> None:
    """``out_takes_tma``: packed heads of the given dtype with 16-byte aligned rows; a padded
    head stride, rows off alignment or another dtype take the masked stores."""
    from attention.triton_kernels.prefill_hopper import out_takes_tma

    packed = torch.empty(5, 4, 128, dtype=torch.bfloat16)
    assert out_takes_tma(packed, torch.bfloat16)
    assert not out_takes_tma(packed, torch.float16)
    assert not out_takes_tma(torch.empty(5, 4, 136, dtype=torch.bfloat16)[..., :128], torch.bfloat16)
    flat = torch.empty(5 * 4 * 128 + 8, dtype=torch.bfloat16)
    assert out_takes_tma(flat[8:].view(5, 4, 128), torch.bfloat16) == (flat[8:].data_ptr() % 16 == 0)
    assert not out_takes_tma(flat[1 : 1 + 5 * 4 * 128].view(5, 4, 128), torch.bfloat16)  # 2 bytes off
    assert not out_takes_tma(torch.empty(5, 1, 4, dtype=torch.bfloat16), torch.bfloat16)  # 8-byte rows


def test_a_key_tile_is_one_two_or_four_boxes_each_inside_a_block() -> None:
    """``kv_box_rows``: the TMA box divides both the block and the 128-key tile, so a tile
    (starting at a multiple of 128) is whole boxes, each starting at a multiple of the box and
    so inside one block; the kernel unrolls at most 4 boxes."""
    from attention.triton_kernels.prefill_hopper import hopper_prefill_shape_ok, kv_box_rows

    for block_size in range(32, 2049, 32):
        box = kv_box_rows(block_size)
        assert block_size % box == 0 and 128 % box == 0 and 128 // box in (1, 2, 4), block_size
        for n0 in range(0, 4 * block_size, 128):  # every box of every tile of 4 blocks
            for b in range(128 // box):
                first = n0 + b * box
                assert first // block_size == (first + box - 1) // block_size, (block_size, first)
        assert hopper_prefill_shape_ok(128, block_size)
    assert [kv_box_rows(b) for b in (32, 64, 96, 128, 160, 192, 256)] == [32, 64, 32, 128, 32, 64, 128]
    assert not any(hopper_prefill_shape_ok(128, b) for b in (0, 16, 48, -32))
