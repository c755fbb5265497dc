"""The token-major V layout of 8-bit caches (``attention.value_layout``): what ``kvcache``
allocates, that torch code indexes it like any cache, and that the cache-write kernels put
every value where the logical view reads it (decode and prefill over it: the kernel and
backend suites, whose fp8 cases are token-major by default)."""

from __future__ import annotations

import pytest
import torch

from attention import LayerCache
from attention.reference import scatter_kv
from attention.triton_kernels import write_kv_cache
from attention.triton_kernels.paging import kernels_interpreted
from attention.triton_kernels.rotary_write import rotary_write_kv
from attention.value_layout import is_token_major, token_major_view, uses_token_major_values, value_is_readable
from examples.engine.parts import cache_config_for
from examples.model import LlamaShape
from kvcache import BlockManager, KVCacheTensors, SwapSpace, allocate_kv_cache

pytestmark = pytest.mark.kernel

DEVICE = "cpu" if kernels_interpreted() else "cuda"
SHAPE = LlamaShape(
    vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16
)
FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8) if t.element_size() == 1 else t.view(torch.int16)


def test_token_major_view_reads_each_block_as_heads_by_dims_by_tokens() -> None:
    memory = torch.arange(3 * 32 * 2 * 8, dtype=torch.float32).view(3, 32, 2, 8)
    value = token_major_view(memory)
    assert value.shape == memory.shape and value.data_ptr() == memory.data_ptr()
    assert is_token_major(value) and value_is_readable(value)
    assert not is_token_major(memory) and value_is_readable(memory)
    # Element (block b, token t, head h, dim d) sits at b*512 + (h*8 + d)*32 + t.
    b, t, h, d = 2, 5, 1, 3
    assert value[b, t, h, d].item() == b * 512 + (h * 8 + d) * 32 + t
    value[b, t, h, d] = -1.0  # a view: writes land in the memory
    assert memory.view(-1)[b * 512 + (h * 8 + d) * 32 + t].item() == -1.0
    # Another permutation of the same memory is neither layout.
    other = memory.view(3, 2, 32, 8).permute(0, 2, 1, 3)
    assert not is_token_major(other) and not value_is_readable(other)
    with pytest.raises(ValueError, match="block_memory: expected a contiguous"):
        token_major_view(value)


@pytest.mark.parametrize(("dtype", "token_major"), [("float8_e4m3", True), ("bfloat16", False), ("float32", False)])
def test_kvcache_allocates_8bit_values_token_major(dtype: str, token_major: bool) -> None:
    compute = "bfloat16" if dtype == "float8_e4m3" else None
    config = cache_config_for(SHAPE, block_size=32, dtype=dtype, num_blocks=6, device="cpu", compute_dtype=compute)
    cache = allocate_kv_cache(config, fill=0.0)
    assert uses_token_major_values(cache.dtype) == token_major
    for i in range(SHAPE.num_layers):
        layer = cache.layer(i)
        assert layer.key.is_contiguous()
        assert layer.value.shape == layer.key.shape
        assert is_token_major(layer.value) == token_major
        assert layer.value.is_contiguous() != token_major
        # V of layer i is exactly storage[i, 1]: nothing else aliases it.
        assert layer.value.data_ptr() == cache.storage[i, 1].data_ptr()


def _random_fp8_cache(seed: int) -> KVCacheTensors:
    """A 6-block fp8 cache (V token-major, as allocated) holding random K/V in every layer."""
    config = cache_config_for(
        SHAPE, block_size=32, dtype="float8_e4m3", num_blocks=6, device="cpu", compute_dtype="bfloat16"
    )
    cache = allocate_kv_cache(config, fill=0.0)
    gen = torch.Generator().manual_seed(seed)
    for i in range(SHAPE.num_layers):
        layer = cache.layer(i)
        layer.key.copy_(torch.randn(layer.key.shape, generator=gen).to(FP8))
        layer.value.copy_(torch.randn(layer.value.shape, generator=gen).to(FP8))
    return cache


def test_block_copies_move_token_major_values_whole() -> None:
    """copy_blocks moves raw storage; read back through the token-major view, the copied
    blocks hold the same logical K/V as their sources (every layer, K and V)."""
    cache = _random_fp8_cache(seed=0)
    before = [(cache.layer(i).key.clone(), cache.layer(i).value.clone()) for i in range(SHAPE.num_layers)]
    cache.copy_blocks([(1, 4), (3, 0)])
    for i, (key, value) in enumerate(before):
        layer = cache.layer(i)
        for src, dst in ((1, 4), (3, 0)):
            assert torch.equal(_bits(layer.key[dst]), _bits(key[src]))
            assert torch.equal(_bits(layer.value[dst]), _bits(value[src]))
        assert torch.equal(_bits(layer.value[2]), _bits(value[2])), "a block that was not copied changed"


def _fp8_layer(token_major: bool, blocks: int = 5, block_size: int = 32, kvh: int = 2, d: int = 16) -> LayerCache:
    """An fp8 layer filled with NaN (0x7f), V contiguous or token-major."""
    storage = torch.full((2, blocks, block_size, kvh, d), 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8)
    value = token_major_view(storage[1]) if token_major else storage[1]
    scales = torch.tensor([0.02, 0.05], device=DEVICE)
    return LayerCache(storage[0], value, k_scale=scales, v_scale=scales * 2)


@pytest.mark.parametrize("kernel", ["write_kv_cache", "rotary_write_kv"])
def test_cache_write_kernels_store_token_major_values_where_the_view_reads_them(kernel: str) -> None:
    """The triton writes into a token-major V leave exactly what the reference write leaves
    in a contiguous one, read through the logical view: the step's slots quantized, every
    other slot's NaN bits untouched (slots -1 and out of range write nothing)."""
    gen = torch.Generator().manual_seed(1)
    tokens = 9
    key = torch.randn(tokens, 2, 16, generator=gen).to(DEVICE)
    value = torch.randn(tokens, 2, 16, generator=gen).to(DEVICE)
    slots = torch.tensor([0, 31, 32, 95, 100, -1, 159, 5, 10_000], device=DEVICE)
    expected = _fp8_layer(token_major=False)
    keep = (slots >= 0) & (slots < expected.num_slots)
    scatter_kv(key[keep], value[keep], expected, slots[keep])
    got = _fp8_layer(token_major=True)
    if kernel == "write_kv_cache":
        write_kv_cache(key, value, got.key, got.value, slots, got.k_scale, got.v_scale)
    else:
        # A rotation at position 0 is the identity: cos 1, sin 0.
        cos_sin = torch.cat((torch.ones(1, 8), torch.zeros(1, 8)), dim=1).to(DEVICE)
        query = torch.randn(tokens, 4, 16, generator=gen).to(DEVICE)
        positions = torch.zeros(tokens, dtype=torch.int64, device=DEVICE)
        rotary_write_kv(query, key, value, got.key, got.value, slots, positions, cos_sin, got.k_scale, got.v_scale)
    assert is_token_major(got.value)
    assert torch.equal(_bits(got.key), _bits(expected.key))
    assert torch.equal(_bits(got.value), _bits(expected.value))


def test_swap_round_trip_keeps_token_major_values() -> None:
    """Swap moves raw blocks: an fp8 sequence swapped out, its blocks overwritten, and swapped
    back into other block ids reads the same logical K/V through the token-major view."""
    cache = _random_fp8_cache(seed=2)
    manager = BlockManager(6, 32)
    swap = SwapSpace(manager, cache, 4)
    manager.allocate("a", 70)  # 3 blocks
    blocks = manager.block_table("a")
    before = [(cache.layer(i).key[blocks].clone(), cache.layer(i).value[blocks].clone()) for i in range(3)]
    swap.swap_out("a")
    manager.allocate("filler", 32)  # takes a freed block, so "a" comes back elsewhere
    cache.storage.view(torch.uint8).fill_(0x7F)  # every block overwritten (fp8 NaN)
    swap.swap_in("a")
    moved = manager.block_table("a")
    assert moved != blocks
    for i, (key, value) in enumerate(before):
        assert torch.equal(_bits(cache.layer(i).key[moved]), _bits(key))
        assert torch.equal(_bits(cache.layer(i).value[moved]), _bits(value))
