"""The host tier of the prefix cache (``kvcache.memory.host_tier``) on CPU tensors: evicted
cached blocks are copied out and come back with their K/V, LRU within the tier, pinned while an
admission uses them, salted, published as events, all or nothing. The stateful fuzz runs a
machine with a host tier too (``test_manager_stateful.py``)."""

from __future__ import annotations

import pytest
import torch

from kvcache import (
    BlockManager,
    BlockRemoved,
    BlockStored,
    InvalidArgumentError,
    KVCacheTensors,
    OutOfBlocksError,
    PrometheusExporter,
    collect_stats,
)
from kvcache.memory.host_tier import HostPrefixTier
from tests.manager_state import snapshot

BS = 4


def setup(device_blocks: int, host_blocks: int) -> tuple[BlockManager, KVCacheTensors, HostPrefixTier]:
    m = BlockManager(device_blocks, BS, enable_prefix_caching=True)
    cache = KVCacheTensors(torch.zeros(2, 2, device_blocks, BS, 1, 3))
    return m, cache, HostPrefixTier(m, cache, host_blocks)


def computed(m: BlockManager, cache: KVCacheTensors, seq: str, ids: list[int], salt: object = None) -> int:
    """Admit ``ids`` and write K/V for the tokens not taken from the cache: every element of a
    token's K/V depends on the whole prefix, as real K/V does."""
    hit = m.allocate(seq, token_ids=ids, extra_key=salt)
    for pos, slot in enumerate(m.slots(seq, hit, len(ids)), start=hit):
        value = float(hash((tuple(ids[: pos + 1]), salt)) % 100_003)
        cache.storage.view(2, 2, -1, 3)[:, :, slot] = value + torch.arange(3.0)
    m.mark_computed(seq, len(ids))
    return hit


def evict_all(m: BlockManager) -> None:
    """Take every device block and give them back: each cached block left the device (to the
    host tier, room permitting)."""
    m.allocate("filler", m.num_blocks * BS)
    m.free("filler")


def kv(m: BlockManager, cache: KVCacheTensors, seq: str, n: int) -> torch.Tensor:
    return cache.storage.view(2, 2, -1, 3)[:, :, m.slots(seq, 0, n)].clone()


def test_evicted_blocks_come_back_from_the_host_with_their_kv() -> None:
    m, cache, tier = setup(device_blocks=6, host_blocks=8)
    prompt = list(range(100, 113))  # 3 full blocks + 1
    computed(m, cache, "a", prompt)
    want = kv(m, cache, "a", 12)
    m.free("a")
    m.allocate("b", 24)  # every device block: a's cached blocks are evicted to the host
    assert tier.stats().offloaded_blocks == 3 and tier.stats().blocks_used == 3
    cache.storage.fill_(float("nan"))  # the device copies are gone
    m.free("b")
    assert m.allocate("c", token_ids=prompt) == 12  # all three full blocks, from the host
    assert torch.equal(kv(m, cache, "c", 12), want)
    stats = tier.stats()
    assert stats.hit_blocks == 3 and stats.bytes_to_device == 3 * cache.bytes_per_block
    assert stats.bytes_to_host == 3 * cache.bytes_per_block and stats.copy_seconds > 0
    m.mark_computed("c", 13)
    m.check_integrity()
    assert tier.integrity_problems() == []
    # The loaded blocks are indexed on the device again: a fourth request hits them there.
    assert m.allocate("d", token_ids=prompt) == 12 and tier.stats().hit_blocks == 3


def test_device_hits_continue_into_the_host() -> None:
    m, cache, tier = setup(device_blocks=8, host_blocks=8)
    prompt = list(range(200, 217))  # 4 full blocks + 1
    computed(m, cache, "a", prompt)
    want = kv(m, cache, "a", 16)
    m.free("a")  # tail first: the last blocks are evicted first
    m.allocate("filler", 6 * BS)  # the 4 uncached free blocks, then a's last 2 cached ones (tail first)
    assert tier.stats().offloaded_blocks == 2
    m.free("filler")
    hit = m.allocate("c", token_ids=prompt)
    assert hit == 16
    assert torch.equal(kv(m, cache, "c", 16), want)


def test_the_host_pool_is_lru_and_publishes_removals() -> None:
    m, cache, tier = setup(device_blocks=4, host_blocks=2)
    sub = m.kv_events.subscribe()
    computed(m, cache, "a", list(range(9)))  # 2 full blocks
    m.free("a")
    evict_all(m)  # both to the host
    computed(m, cache, "c", list(range(50, 59)))
    m.free("c")
    m.allocate("d", 16)  # c's two to the host, which drops a's (least recently used)
    events = sub.poll()
    host = [e for e in events if e.tier == "host"]
    assert [type(e) for e in host] == [BlockStored, BlockStored, BlockRemoved, BlockStored, BlockRemoved, BlockStored]
    assert tier.stats().dropped_blocks == 2
    m.free("d")
    assert m.allocate("again", token_ids=list(range(9))) == 0  # a's blocks are gone everywhere
    replay = m.kv_events.subscribe().poll()
    assert sorted(e.tier for e in replay) == ["host", "host"]


def test_a_tenant_gets_no_hit_on_another_tenants_host_blocks() -> None:
    m, cache, tier = setup(device_blocks=4, host_blocks=8)
    prompt = list(range(9))
    computed(m, cache, "a", prompt, salt="tenant-a")
    m.free("a")
    evict_all(m)
    assert tier.stats().blocks_used == 2
    assert m.allocate("other", token_ids=prompt, extra_key="tenant-b") == 0
    m.free("other")
    assert m.allocate("same", token_ids=prompt, extra_key="tenant-a") == 8


def test_a_refused_admission_changes_nothing_in_either_tier() -> None:
    m, cache, tier = setup(device_blocks=4, host_blocks=8)
    prompt = list(range(9))
    computed(m, cache, "a", prompt)
    m.free("a")
    evict_all(m)
    m.allocate("hog", 12)  # one device block left; the prompt needs three
    before, host_before, held = snapshot(m, None), tier.host.clone(), tier.held_keys()
    assert not m.can_allocate(token_ids=prompt)
    with pytest.raises(OutOfBlocksError):
        m.allocate("c", token_ids=prompt)
    assert snapshot(m, None) == before and tier.held_keys() == held
    assert torch.equal(tier.host.view(torch.uint8), host_before.view(torch.uint8))  # bit for bit: NaN != NaN
    assert tier._pinned == {}


def test_an_admission_keeps_its_own_host_hits_while_it_evicts_into_a_full_host() -> None:
    m, cache, tier = setup(device_blocks=4, host_blocks=2)
    p = list(range(9))
    computed(m, cache, "p", p)
    want = kv(m, cache, "p", 8)
    m.free("p")
    evict_all(m)  # p's two blocks are on the host, which is now full
    computed(m, cache, "q", list(range(60, 73)))  # three cached blocks of q on the device
    m.free("q")
    # Admitting p takes three fresh blocks, evicting q's cached ones: the host has no room
    # but for p's own hits, which it keeps.
    assert m.allocate("p2", token_ids=p) == 8
    assert torch.equal(kv(m, cache, "p2", 8), want)
    assert tier.integrity_problems() == [] and tier._pinned == {}


def test_construction_is_checked() -> None:
    m = BlockManager(4, BS, enable_prefix_caching=True)
    cache = KVCacheTensors(torch.zeros(1, 2, 4, BS, 1, 2))
    with pytest.raises(InvalidArgumentError, match="num_host_blocks"):
        HostPrefixTier(m, cache, 0)
    with pytest.raises(InvalidArgumentError, match="enable_prefix_caching"):
        HostPrefixTier(BlockManager(4, BS), cache, 2)
    with pytest.raises(InvalidArgumentError, match="cache"):
        HostPrefixTier(m, KVCacheTensors(torch.zeros(1, 2, 2, BS, 1, 2)), 2)
    HostPrefixTier(m, cache, 2)
    with pytest.raises(InvalidArgumentError, match="tier already"):
        HostPrefixTier(m, cache, 2)


def test_collect_stats_and_prometheus_report_the_host_tier() -> None:
    m, cache, _ = setup(device_blocks=4, host_blocks=8)
    prompt = list(range(9))
    computed(m, cache, "a", prompt)
    m.free("a")
    evict_all(m)
    m.allocate("c", token_ids=prompt)
    stats = collect_stats(m)
    assert (stats.prefix_host_blocks_total, stats.prefix_host_blocks_used) == (8, 2)
    assert (stats.prefix_host_offloaded_blocks, stats.prefix_host_hit_blocks) == (2, 2)
    assert stats.prefix_host_bytes_to_device == 2 * cache.bytes_per_block
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    PrometheusExporter(registry=registry).update(stats)
    value = registry.get_sample_value
    assert value("kvcache_prefix_cache_tier_hit_blocks_total", {"tier": "host"}) == 2
    assert value("kvcache_prefix_cache_tier_bytes_total", {"tier": "host", "direction": "to_host"}) == (
        2 * cache.bytes_per_block
    )
    assert value("kvcache_prefix_cache_tier_blocks", {"tier": "host", "state": "used"}) == 2
    assert collect_stats(BlockManager(4, BS)).prefix_host_blocks_total == 0
