"""Step metadata and cache tensors."""

from __future__ import annotations

import pytest
import torch

from attention import LayerCache
from kvcache import (
    BlockManager,
    CacheAllocationError,
    InvalidArgumentError,
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


def shown(meta: object, row: int, n: int) -> list[int]:
    """The first ``n`` block-table entries of ``row``: the ones a kernel reads (the table is a
    [padded_batch, capacity width] view of the builder's persistent buffer; entries past a
    row's blocks are unspecified)."""
    return meta.block_tables[row, :n].tolist()  # type: ignore[attr-defined]


def test_metadata_for_a_mixed_step() -> None:
    m = BlockManager(num_blocks=10, block_size=4)
    m.allocate("prefill", 9)  # blocks 0, 1, 2
    m.allocate("decode", 5)  # blocks 3, 4
    m.mark_computed("prefill", 4)  # its first chunk ran
    m.mark_computed("decode", 5)
    m.append_slots("decode", 1)
    builder = MetadataBuilder("cpu")
    meta = builder.build(m, [ScheduledRow("decode", 1), ScheduledRow("prefill", 5, start=4)])
    # Was [[3, 4, PAD_BLOCK], [0, 1, 2]] at the step's width; now the width is the builder's
    # max_blocks_per_seq and the entries past a row's blocks are unspecified.
    assert meta.block_tables.shape == (2, builder.capacity.max_blocks_per_seq)
    assert [shown(meta, 0, 2), shown(meta, 1, 3)] == [[3, 4], [0, 1, 2]]
    assert meta.seq_lens.tolist() == [6, 9]
    assert meta.query_start_loc.tolist() == [0, 1, 6]
    assert meta.slot_mapping.tolist() == [4 * 4 + 1, 4, 5, 6, 7, 8]  # position 5 of "decode" is in block 4
    assert meta.positions.tolist() == [5, 4, 5, 6, 7, 8]
    # Both rows reach the end of their reserved tokens: each needs its last token's logits.
    assert meta.logits_indices.tolist() == [0, 5] and meta.sampling_rows_host == (0, 1)
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.positions.dtype == torch.int64 and meta.logits_indices.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len, meta.is_pure_decode) == (5, 9, False)
    meta.check()


def test_block_table_covers_the_blocks_the_row_reads() -> None:
    # Was: the table is exactly [[0]] (the step's width). Persistent rows now show every block
    # of the record (the row is written once, not per chunk); what a kernel reads is still
    # only what seq_len covers, and a chunk short of the prompt's end samples nothing.
    m = BlockManager(num_blocks=10, block_size=4)
    m.allocate("p", 12)  # the whole prompt is reserved, only a first chunk is scheduled
    meta = build_metadata(m, [ScheduledRow("p", 3, start=0)], "cpu")
    assert shown(meta, 0, 1) == [0]
    assert meta.seq_lens.tolist() == [3]
    assert meta.positions.tolist() == [0, 1, 2]
    assert meta.logits_indices.tolist() == [] and meta.sampling_rows_host == ()
    meta.check()


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
    first_slots = first.slot_mapping.tolist()  # the next build overwrites the same buffers
    m.append_slots("a", 2)
    second = builder.build(m, [ScheduledRow("a", 2)])
    assert first_slots == [0, 1, 2]
    assert second.slot_mapping.tolist() == [3, 4]
    assert shown(second, 0, 2) == [0, 1]
    # Persistent buffers: the second step's tensors are views of the same memory.
    assert second.slot_mapping.data_ptr() == first.slot_mapping.data_ptr()
    assert second.block_tables.data_ptr() == first.block_tables.data_ptr()


def test_cache_tensors_shape_layout_and_block_copy() -> None:
    cache = allocate_kv_cache(CONFIG, fill=float("nan"))
    assert cache.storage.shape == (3, 2, 10, 32, 2, 8)
    assert cache.nbytes == 10 * CONFIG.bytes_per_block
    assert cache.bytes_per_block == CONFIG.bytes_per_block
    layer = cache.layer(1)
    assert isinstance(layer, LayerCache) and layer.index == 1
    assert cache.layer(1) is layer, "the same LayerCache object every time"
    assert layer.k_scale is None and layer.v_scale is None
    k, v = layer.key, layer.value
    assert k.shape == (10, 32, 2, 8) and k.is_contiguous() and v.is_contiguous()
    assert k.data_ptr() != v.data_ptr()
    assert (layer.num_blocks, layer.block_size, layer.num_slots) == (10, 32, 320)
    for i in range(3):
        cache.key[i][4] = i + 1.0
        cache.value[i][4] = -(i + 1.0)
    cache.copy_blocks([(4, 7)])
    for i in range(3):
        assert torch.equal(cache.key[i][7], cache.key[i][4])
        assert torch.equal(cache.value[i][7], cache.value[i][4])
        assert torch.equal(cache.layer(i).key[7], cache.key[i][4])  # the layer views share storage
    assert torch.isnan(cache.key[0][5]).all(), "a block that was not copied changed"


def test_copy_blocks_validates_ids_and_copies_nothing_on_error() -> None:
    cache = allocate_kv_cache(CONFIG, fill=0.0)
    cache.storage[:, :, 4] = 1.0
    before = cache.storage.clone()
    for bad in ([(4, 10)], [(-1, 3)], [(4, 5), (4, 5)], [(4, 5), (5, 6)], [(4, 5.0)], [(True, 5)]):
        with pytest.raises(InvalidArgumentError):
            cache.copy_blocks(bad)  # type: ignore[arg-type]
        assert torch.equal(cache.storage, before), f"copy_blocks({bad}) changed the cache"
    cache.copy_blocks([])
    assert torch.equal(cache.storage, before)


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
