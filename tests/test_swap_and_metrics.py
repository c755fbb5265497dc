"""CPU swap (bit-identical round trips, all-or-nothing) and the metrics snapshot/exporter."""

from __future__ import annotations

import pytest
import torch

from kvcache import (
    BlockManager,
    KVCacheTensors,
    OutOfBlocksError,
    PrometheusExporter,
    SwapSpace,
    UnknownSequenceError,
    collect_stats,
    preempt,
)


def setup(num_blocks: int = 8, host_blocks: int = 4, dtype: torch.dtype = torch.bfloat16):
    m = BlockManager(num_blocks, 4)
    cache = KVCacheTensors(torch.randn(2, 2, num_blocks, 4, 2, 8).to(dtype))
    return m, cache, SwapSpace(m, cache, host_blocks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swap_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    m, cache, swap = setup(dtype=dtype)
    m.allocate("a", 10)  # blocks 0, 1, 2
    m.allocate("b", 3)  # block 3
    before = cache.storage[:, :, m.block_table("a")].clone()
    out = swap.swap_out("a")
    assert [d for d, _ in out] == [0, 1, 2] and "a" not in m and swap.is_swapped("a")
    cache.storage[:, :, [0, 1, 2]] = torch.nan  # the freed blocks get overwritten by others
    m.allocate("c", 12)  # takes the freed blocks
    m.free("c")
    back = swap.swap_in("a")
    assert [h for h, _ in back] == [h for _, h in out]
    after = cache.storage[:, :, m.block_table("a")]
    assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))  # bit for bit
    assert m.num_tokens("a") == 10 and swap.allocator.num_free == 4
    m.check_integrity()
    assert swap.integrity_problems() == []


def test_swap_is_all_or_nothing() -> None:
    m, _cache, swap = setup(num_blocks=8, host_blocks=2)
    m.allocate("big", 12)  # 3 blocks: more than the host pool
    host_before = swap.host.clone()
    assert not swap.can_swap_out("big")
    with pytest.raises(OutOfBlocksError, match="host pool"):
        swap.swap_out("big")
    assert "big" in m and swap.allocator.num_free == 2
    assert torch.equal(swap.host.view(torch.uint8), host_before.view(torch.uint8))
    m.allocate("small", 5)  # 2 blocks
    swap.swap_out("small")
    m.allocate("hog", 4 * 5)  # fill the device: 3 + 5 = 8 blocks in use
    assert not swap.can_swap_in("small")
    with pytest.raises(OutOfBlocksError):
        swap.swap_in("small")
    assert swap.is_swapped("small") and "small" not in m
    m.free("hog")
    swap.swap_in("small")
    m.check_integrity()


def test_swap_errors_name_the_sequence() -> None:
    m, _, swap = setup()
    with pytest.raises(UnknownSequenceError):
        swap.swap_out("nope")
    with pytest.raises(UnknownSequenceError):
        swap.swap_in("nope")
    m.allocate("a", 1)
    with pytest.raises(Exception, match="already has blocks"):
        swap.swap_in("a")


def test_preempt_modes_are_counted() -> None:
    m, _, swap = setup()
    m.allocate("r", 5)
    m.allocate("s", 5)
    preempt(m, "r", "recompute")
    preempt(m, "s", "swap", swap)
    with pytest.raises(ValueError, match="'pause' is not a preemption mode"):
        preempt(m, "s", "pause")
    with pytest.raises(ValueError, match="needs the SwapSpace"):
        m.allocate("t", 1)
        preempt(m, "t", "swap")
    stats = collect_stats(m, swap)
    assert (stats.preemptions_recompute, stats.preemptions_swap, stats.preemptions) == (1, 1, 2)
    assert (stats.swapped_out_blocks, stats.sequences_swapped, stats.host_blocks_used) == (2, 1, 2)


def test_stats_counts_blocks_and_prefix_tokens() -> None:
    m = BlockManager(8, 4, enable_prefix_caching=True)
    m.allocate("a", token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.mark_computed("a", 9)
    m.allocate("b", token_ids=[1, 2, 3, 4, 0])
    m.free("a")
    stats = collect_stats(m)
    assert (stats.blocks_total, stats.blocks_used, stats.blocks_free) == (8, 2, 6)
    assert (stats.blocks_cached, stats.blocks_cached_free) == (2, 1)  # block 0 shared with b
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (14, 4)
    assert stats.usage == 2 / 8 and stats.prefix_hit_rate == 4 / 14


def test_prometheus_exporter_uses_vllm_like_names() -> None:
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    exporter = PrometheusExporter(registry=registry)
    m = BlockManager(8, 4, enable_prefix_caching=True)
    m.allocate("a", token_ids=[1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    exporter.update(collect_stats(m))
    m.allocate("b", token_ids=[1, 2, 3, 4, 6])
    exporter.update(collect_stats(m))
    value = registry.get_sample_value
    assert value("kvcache_kv_cache_usage_perc") == 3 / 8
    assert value("kvcache_prefix_cache_queries_total") == 10
    assert value("kvcache_prefix_cache_hits_total") == 4
    assert value("kvcache_num_preemptions_total", {"mode": "swap"}) == 0
