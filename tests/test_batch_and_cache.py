"""Step metadata and cache tensors."""

from __future__ import annotations

import pytest
import torch

from attention import PAD_BLOCK
from kvcache import (
    BlockManager,
    CacheAllocationError,
    MetadataBuilder,
    ScheduledRow,
    allocate_kv_cache,
    build_metadata,
    parse_config,
)

CONFIG = parse_config(
    "model: {num_layers: 3, num_heads: 4, num_kv_heads: 2, head_dim: 8}\n"
    "cache: {block_size: 32, dtype: float32, num_blocks: 10, device: cpu}\n"
)


def test_metadata_for_a_mixed_step() -> None:
    m = BlockManager(num_blocks=10, block_size=4)
    m.allocate("prefill", 9)  # blocks 0, 1, 2
    m.allocate("decode", 5)  # blocks 3, 4
    m.append_slots("decode", 1)
    meta = build_metadata(
        m, [ScheduledRow("decode", 1), ScheduledRow("prefill", 5, start=4)], "cpu"
    )
    assert meta.block_tables.tolist() == [[3, 4, PAD_BLOCK], [0, 1, 2]]
    assert meta.seq_lens.tolist() == [6, 9]
    assert meta.query_start_loc.tolist() == [0, 1, 6]
    assert meta.slot_mapping.tolist() == [4 * 4 + 1, 4, 5, 6, 7, 8]  # position 5 of "decode" is in block 4
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len, meta.is_pure_decode) == (5, 9, False)
    meta.check()


def test_block_table_covers_only_blocks_the_row_reads() -> None:
    m = BlockManager(num_blocks=10, block_size=4)
    m.allocate("p", 12)  # the whole prompt is reserved, only a first chunk is scheduled
    meta = build_metadata(m, [ScheduledRow("p", 3, start=0)], "cpu")
    assert meta.block_tables.tolist() == [[0]]
    assert meta.seq_lens.tolist() == [3]


def test_rows_outside_reserved_tokens_are_refused() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 3)
    with pytest.raises(ValueError, match=r"rows\[0\].*append_slots first"):
        build_metadata(m, [ScheduledRow("a", 2, start=2)], "cpu")
    with pytest.raises(ValueError, match="at least one"):
        build_metadata(m, [], "cpu")


def test_builder_reuses_itself_across_steps() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 3)
    builder = MetadataBuilder("cpu")
    first = builder.build(m, [ScheduledRow("a", 3)])
    m.append_slots("a", 2)
    second = builder.build(m, [ScheduledRow("a", 2)])
    assert first.slot_mapping.tolist() == [0, 1, 2]
    assert second.slot_mapping.tolist() == [3, 4]
    assert second.block_tables.tolist() == [[0, 1]]


def test_cache_tensors_shape_layout_and_block_copy() -> None:
    cache = allocate_kv_cache(CONFIG, fill=float("nan"))
    assert cache.storage.shape == (3, 2, 10, 32, 2, 8)
    assert cache.nbytes == 10 * CONFIG.bytes_per_block
    k, v = cache.layer(1)
    assert k.shape == (10, 32, 2, 8) and k.is_contiguous() and v.is_contiguous()
    assert k.data_ptr() != v.data_ptr()
    for layer in range(3):
        cache.key[layer][4] = layer + 1.0
        cache.value[layer][4] = -(layer + 1.0)
    cache.copy_blocks([(4, 7)])
    for layer in range(3):
        assert torch.equal(cache.key[layer][7], cache.key[layer][4])
        assert torch.equal(cache.value[layer][7], cache.value[layer][4])
    assert torch.isnan(cache.key[0][5]).all(), "a block that was not copied changed"


def test_cache_that_cannot_fit_names_the_largest_that_does() -> None:
    with pytest.raises(CacheAllocationError, match="largest num_blocks that fits is"):
        allocate_kv_cache(CONFIG, num_blocks=10**12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_cuda_cache_without_cuda_says_so() -> None:
    config = parse_config(
        "model: {num_layers: 1, num_heads: 1, num_kv_heads: 1, head_dim: 8}\n"
        "cache: {block_size: 32, num_blocks: 1, device: cuda}\n"
    )
    with pytest.raises(CacheAllocationError, match="no CUDA device"):
        allocate_kv_cache(config)
