"""The int8 cache with a scale per (token, KV head) (``attention.token_scales``): the config
and what it costs, how ``kvcache`` lays the blocks out, the quantization itself, and that block
moves carry the scales with the values. Attention over it: ``test_backend_contract.py``
(``test_int8_cache``) and the kernel suites."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attention import AttentionSpec
from attention.dtypes import dtype_info
from attention.errors import InvalidArgumentError
from attention.quantize import dequantize
from attention.reference import scatter_kv
from attention.token_scales import INT8_MAX, SCALE_MAX, layout_problem, quantize_rows, split_block_memory
from examples.engine.parts import cache_config_for
from examples.model import LlamaShape
from kvcache import BlockManager, ConfigError, KVCacheTensors, SwapSpace, allocate_kv_cache, parse_config

SHAPE = LlamaShape(
    vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16
)


def _config(num_blocks: int = 6, block_size: int = 32):
    return cache_config_for(
        SHAPE, block_size=block_size, dtype="int8", num_blocks=num_blocks, device="cpu", compute_dtype="bfloat16"
    )


def test_rows_per_block_hold_the_values_and_two_bytes_per_token_and_head() -> None:
    info = dtype_info("int8")
    assert info.rows_per_block(32, 128) == 33  # 32 x 2 bytes per head fit one row of 128
    assert info.rows_per_block(256, 128) == 260
    assert info.rows_per_block(32, 16) == 36
    assert dtype_info("float8_e4m3").rows_per_block(32, 16) == 32
    assert info.rows_per_block(32, 24) == 36  # 3 rows would hold the scales; 4 keep blocks aligned


@pytest.mark.parametrize("block_size", [32, 64, 96, 160, 256, 1024])
@pytest.mark.parametrize("head_dim", [8, 16, 24, 40, 64, 72, 96, 128, 200, 256])
def test_blocks_start_where_the_kernels_aligned_loads_assume(block_size: int, head_dim: int) -> None:
    """Every block's start (values and scales) is a multiple of the largest power of two
    dividing block_size elements for any kv_heads (the token-major V offsets promise Triton
    that much contiguity), and the rows hold the scales."""
    rows = dtype_info("int8").rows_per_block(block_size, head_dim)
    extra = (rows - block_size) * head_dim
    assert extra >= 2 * block_size, "the scales must fit"
    assert extra % (block_size & -block_size) == 0
    assert extra < 2 * block_size + (block_size & -block_size) * head_dim, "no more padding than alignment needs"


def test_config_counts_the_scales_in_bytes_per_token() -> None:
    config = parse_config(
        """
model: {num_layers: 32, num_heads: 32, num_kv_heads: 8, head_dim: 128, dtype: bfloat16}
cache: {block_size: 256, dtype: int8, num_blocks: 4, device: cpu}
"""
    )
    # 2 x 32 layers x 8 heads x (128 values + 2 bytes of scale) per token.
    assert config.bytes_per_token == 2 * 32 * 8 * 130
    assert config.bytes_per_block == 2 * 32 * 260 * 8 * 128
    bf16 = config.model_copy(update={"cache": config.cache.model_copy(update={"dtype": "bfloat16"})})
    assert config.bytes_per_token / bf16.bytes_per_token == pytest.approx(130 / 256)


def test_int8_needs_a_compute_dtype_and_is_refused_for_a_latent_cache() -> None:
    with pytest.raises(ConfigError, match=r"model\.dtype.*int8"):
        parse_config(
            "model: {num_layers: 1, num_heads: 2, num_kv_heads: 1, head_dim: 16}\n"
            "cache: {block_size: 32, dtype: int8, num_blocks: 2, device: cpu}\n"
        )
    with pytest.raises(ConfigError, match=r"cache\.dtype.*latent"):
        parse_config(
            "model: {num_layers: 1, num_heads: 4, num_kv_heads: 1, head_dim: 192, dtype: bfloat16, kv_lora_rank: 64,"
            " qk_rope_head_dim: 64, qk_nope_head_dim: 128, v_head_dim: 128}\n"
            "cache: {block_size: 32, dtype: int8, num_blocks: 2, device: cpu}\nattention: {backend: reference}\n"
        )
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype: int8"):
        AttentionSpec(4, 1, 192, "bfloat16", kv_cache_dtype="int8", latent_rank=128)
    with pytest.raises(ConfigError, match=r"int8"):
        parse_config(
            "model: {num_layers: 1, num_heads: 2, num_kv_heads: 1, head_dim: 64, dtype: bfloat16}\n"
            "cache: {block_size: 256, dtype: int8, num_blocks: 2, device: cpu}\nattention: {backend: flash_attn}\n"
        )
    with pytest.raises(ConfigError, match=r"cache\.kv_scale: is given with cache\.dtype int8.*remove kv_scale"):
        parse_config(
            "model: {num_layers: 1, num_heads: 2, num_kv_heads: 1, head_dim: 16, dtype: bfloat16}\n"
            "cache: {block_size: 32, dtype: int8, num_blocks: 2, device: cpu, kv_scale: 0.05}\n"
        )


def test_kvcache_lays_each_block_out_as_values_then_scales() -> None:
    config = _config()
    cache = allocate_kv_cache(config, fill=float("nan"))
    rows = dtype_info("int8").rows_per_block(32, 16)
    assert cache.storage.shape == (3, 2, 6, rows, 2, 16) and cache.dtype == torch.int8
    assert cache.block_size == 32 and cache.scales is None
    assert cache.bytes_per_block == config.bytes_per_block
    for i in range(3):
        layer = cache.layer(i)
        assert layer.key.shape == layer.value.shape == (6, 32, 2, 16)
        assert layer.k_scale is not None and layer.k_scale.shape == (6, 32, 2)
        assert layer.k_scale.dtype == torch.float16
        assert layer_problem(layer) is None
        assert bool(layer.k_scale.isnan().all()), "fill=nan poisons the scales"
        assert layer.key.data_ptr() == cache.storage[i, 0].data_ptr()
    # Block 3's bytes: the values first, then head 1's scale of token 5 at [values + (1 * 32 + 5) * 2].
    memory = cache.storage[1, 0, 3].flatten()
    layer = cache.layer(1)
    assert layer.k_scale is not None
    layer.k_scale[3, 5, 1] = 0.5
    offset = 32 * 2 * 16 + (1 * 32 + 5) * 2
    assert memory[offset : offset + 2].view(torch.float16).item() == 0.5
    layer.value[3, 7, 1, 2] = 9  # V token-major: [heads, dims, tokens]
    assert cache.storage[1, 1, 3].flatten()[(1 * 16 + 2) * 32 + 7].item() == 9


def layer_problem(layer) -> str | None:  # type: ignore[no-untyped-def]
    return layout_problem(layer.key, layer.value, layer.k_scale, layer.v_scale)


def test_split_block_memory_refuses_memory_too_small_for_the_scales() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        split_block_memory(torch.zeros(2, 32, 2, 16, dtype=torch.int8), 32, token_major=False)
    with pytest.raises(ValueError, match="int8"):
        split_block_memory(torch.zeros(2, 36, 2, 16), 32, token_major=False)


def test_quantize_rows_scales_each_row_by_its_largest_magnitude() -> None:
    x = torch.tensor(
        [
            [127.0, 63.5, -63.5, 0.0, 1.49, -1.5],  # scale 1: halves round away from zero
            [0.0] * 6,  # nothing to scale: scale 0, values 0
            [1e9, -1e9, 5e6, 0.0, 0.0, 0.0],  # beyond 127 x 65504: the scale saturates
            [0.254, 0.127, -0.001, 0.0, 0.0, 0.0],
        ]
    )
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    assert q[0].tolist() == [127, 64, -64, 0, 1, -2]
    assert scale[0].item() == 1.0
    assert q[1].tolist() == [0] * 6 and scale[1].item() == 0.0
    assert scale[2].item() == SCALE_MAX and q[2, :3].tolist() == [127, -127, 76]
    s = scale[3].float()
    assert s.item() == pytest.approx(0.254 / INT8_MAX, rel=1e-3)
    assert q[3, :3].tolist() == [round(0.254 / s.item()), round(0.127 / s.item()), 0]


def test_quantized_rows_are_within_half_a_step_of_the_input() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, 64, generator=gen) * torch.logspace(-3, 2, 200)[:, None, None]
    q, scale = quantize_rows(x.bfloat16())
    back = dequantize(q[None], scale[None], torch.float32)[0]
    step = scale.float()[..., None]
    assert bool(((back - x.bfloat16().float()).abs() <= step * 0.5 + 1e-6 * x.abs()).all())
    assert int(q.abs().amax(-1).min()) == INT8_MAX, "every row uses the whole range"


def _random_cache(seed: int) -> KVCacheTensors:
    """An int8 cache whose every slot of every layer was written with random K/V."""
    cache = allocate_kv_cache(_config(), fill=float("nan"))
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(cache.num_blocks * cache.block_size)
    for i in range(SHAPE.num_layers):
        k = torch.randn(slots.numel(), 2, 16, generator=gen) * (i + 1)
        v = torch.randn(slots.numel(), 2, 16, generator=gen)
        scatter_kv(k.bfloat16(), v.bfloat16(), cache.layer(i), slots)
    return cache


def _read(cache: KVCacheTensors, layer: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    view = cache.layer(layer)
    return (
        dequantize(view.key[blocks], None if view.k_scale is None else view.k_scale[blocks], torch.float32),
        dequantize(view.value[blocks], None if view.v_scale is None else view.v_scale[blocks], torch.float32),
    )


def test_block_copies_carry_the_scales() -> None:
    cache = _random_cache(seed=1)
    before = [_read(cache, i, [0, 4]) for i in range(3)]
    cache.copy_blocks([(0, 2), (4, 5)])
    for i, (k, v) in enumerate(before):
        k2, v2 = _read(cache, i, [2, 5])
        assert torch.equal(k2, k) and torch.equal(v2, v)


def test_swap_round_trip_keeps_values_and_scales() -> None:
    cache = _random_cache(seed=2)
    manager = BlockManager(6, 32)
    swap = SwapSpace(manager, cache, 4)
    manager.allocate("a", 70)  # 3 blocks
    blocks = manager.block_table("a")
    before = [_read(cache, i, blocks) for i in range(3)]
    swap.swap_out("a")
    manager.allocate("filler", 32)  # takes a freed block, so "a" comes back elsewhere
    cache.storage.fill_(0x7E)  # every block overwritten: scales NaN
    swap.swap_in("a")
    moved = manager.block_table("a")
    assert moved != blocks
    for i, (k, v) in enumerate(before):
        k2, v2 = _read(cache, i, moved)
        assert torch.equal(k2, k) and torch.equal(v2, v)


def test_an_int8_cache_has_no_per_head_scales_to_set_or_calibrate() -> None:
    from kvcache.memory.calibration import apply_scales, scales_from_cache

    cache = allocate_kv_cache(_config(), fill=0.0)
    with pytest.raises(InvalidArgumentError, match="int8: its scales are per token"):
        cache.set_scales(0, torch.ones(2), torch.ones(2))
    with pytest.raises(InvalidArgumentError, match="not an 8-bit one"):
        scales_from_cache(cache)  # its bytes are values and scales, not K/V to take the largest of
    with pytest.raises(InvalidArgumentError, match="scales: expected shape None"):
        apply_scales(cache, torch.ones(3, 2, 2))


def test_the_example_runs_over_an_int8_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from examples.decode_loop import main

    config = tmp_path / "int8.yaml"
    config.write_text(
        "model: {num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16, dtype: bfloat16}\n"
        "cache: {block_size: 32, dtype: int8, num_blocks: 24, device: cpu, swap_space: 256KiB}\n"
        "attention: {backend: reference}\n"
    )
    assert main(["--config", str(config), "--quiet", "--requests", "6", "--preempt", "swap"]) == 0
    assert "requests: 6 (6 finished" in capsys.readouterr().out


def test_kv_groups_over_an_int8_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model mixing windowed and full layers (KV groups): the int8 cache holds group_size
    layer tensors, each layer's views land on its group's tensor, and the example serves it."""
    from examples.decode_loop import main

    text = (
        "model: {num_layers: 4, num_heads: 4, num_kv_heads: 2, head_dim: 16, dtype: float32, sliding_window: 48,\n"
        "        window_pattern: [true, false, true, false]}\n"
        "cache: {block_size: 32, dtype: int8, num_blocks: 24, device: cpu}\n"
        "attention: {backend: reference}\n"
    )
    cache = allocate_kv_cache(parse_config(text))
    assert cache.layout is not None and cache.num_tensors == 2 and cache.block_size == 32
    assert cache.layer(0).key.data_ptr() == cache.layer(1).key.data_ptr() == cache.storage[0, 0].data_ptr()
    assert cache.layer(2).key.data_ptr() == cache.storage[1, 0].data_ptr()
    config = tmp_path / "groups.yaml"
    config.write_text(text)
    assert main(["--config", str(config), "--quiet", "--requests", "6"]) == 0
    assert "requests: 6 (6 finished" in capsys.readouterr().out


def test_quantized_layer_holds_dense_kv_as_the_write_stores_it() -> None:
    """attention.token_scales.quantized_layer (what the benchmarks build caches with): the
    layout the kernels take, and each row's values and scale as quantize_rows gives them."""
    from attention.token_scales import quantized_layer

    gen = torch.Generator().manual_seed(3)
    key, value = (torch.randn(3, 32, 2, 16, generator=gen).bfloat16() for _ in range(2))
    layer = quantized_layer(key, value, index=4)
    assert layer.index == 4 and layer_problem(layer) is None
    for dense, values, scales in ((key, layer.key, layer.k_scale), (value, layer.value, layer.v_scale)):
        q, s = quantize_rows(dense)
        assert scales is not None
        assert torch.equal(values, q) and torch.equal(scales, s)
