"""Cache metrics: a snapshot of the block pool, the prefix cache and its host tier, swaps and
preemptions, and an optional Prometheus exporter whose names follow vLLM's
(``kv_cache_usage_perc``, ``prefix_cache_queries``, ``prefix_cache_hits``, ``num_preemptions``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from attention.errors import ArgumentTypeError, InvalidArgumentError
from kvcache.blocks.hybrid import require_one_table
from kvcache.blocks.manager import BlockManager
from kvcache.memory.disk_tier import DiskTierStats
from kvcache.memory.host_tier import HostPrefixTier
from kvcache.memory.swap import SwapSpace

__all__ = ["CacheStats", "PrometheusExporter", "collect_stats"]


@dataclass(frozen=True)
class CacheStats:
    """One snapshot. Token counts for the prefix cache; block counts elsewhere."""

    blocks_total: int
    blocks_used: int
    blocks_free: int
    #: Blocks indexed by the prefix cache (in use or waiting in the free queue).
    blocks_cached: int
    #: Free blocks that still hold cached K/V (reused last, LRU).
    blocks_cached_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    preemptions_recompute: int
    preemptions_swap: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    host_blocks_total: int
    host_blocks_used: int
    sequences_running: int
    sequences_swapped: int
    #: The prefix cache's host tier (zeros without one): its blocks, blocks admission took from
    #: it, evicted device blocks copied in, host blocks dropped for room, bytes each way, and the
    #: copies' time (GPU time of completed copies on CUDA).
    prefix_host_blocks_total: int = 0
    prefix_host_blocks_used: int = 0
    prefix_host_hit_blocks: int = 0
    prefix_host_offloaded_blocks: int = 0
    prefix_host_dropped_blocks: int = 0
    prefix_host_bytes_to_host: int = 0
    prefix_host_bytes_to_device: int = 0
    prefix_host_copy_seconds: float = 0.0
    #: The disk tier below it (zeros without one): its files' blocks (the bound and in use),
    #: blocks read back, written, deleted for room, and found damaged (recomputed), payload
    #: bytes each way.
    prefix_disk_blocks_total: int = 0
    prefix_disk_blocks_used: int = 0
    prefix_disk_hit_blocks: int = 0
    prefix_disk_written_blocks: int = 0
    prefix_disk_dropped_blocks: int = 0
    prefix_disk_corrupt_blocks: int = 0
    prefix_disk_bytes_read: int = 0
    prefix_disk_bytes_written: int = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.blocks_used / self.blocks_total

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens over queried tokens (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(usage=self.usage, prefix_hit_rate=self.prefix_hit_rate, preemptions=self.preemptions)
        return out


def collect_stats(manager: BlockManager, swap_space: SwapSpace | None = None) -> CacheStats:
    """Snapshot ``manager`` (and its swap space). O(1). Raises ArgumentTypeError for
    arguments of the wrong type and InvalidArgumentError for a swap space of another manager
    (its counts would mix two pools)."""
    require_one_table(manager)
    if swap_space is not None:
        if not isinstance(swap_space, SwapSpace):
            raise ArgumentTypeError(f"swap_space: expected a SwapSpace or None, got {type(swap_space).__name__}")
        if swap_space.manager is not manager:
            raise InvalidArgumentError("swap_space: it belongs to another manager; pass that manager's swap space")
    cache = manager.prefix_cache
    alloc = manager.allocator
    tier = manager.lower_tier
    host = tier.stats() if isinstance(tier, HostPrefixTier) else None
    return CacheStats(
        blocks_total=alloc.num_blocks,
        blocks_used=alloc.num_used,
        blocks_free=alloc.num_free,
        blocks_cached=len(cache) if cache is not None else 0,
        blocks_cached_free=alloc.num_cached_free,
        prefix_cache_queries=cache.query_tokens if cache is not None else 0,
        prefix_cache_hits=cache.hit_tokens if cache is not None else 0,
        prefix_cache_evictions=cache.evictions if cache is not None else 0,
        preemptions_recompute=manager.preemptions["recompute"],
        preemptions_swap=manager.preemptions["swap"],
        swapped_out_blocks=swap_space.swapped_out_blocks if swap_space else 0,
        swapped_in_blocks=swap_space.swapped_in_blocks if swap_space else 0,
        host_blocks_total=swap_space.num_host_blocks if swap_space else 0,
        host_blocks_used=swap_space.allocator.num_used if swap_space else 0,
        sequences_running=manager.num_sequences,
        sequences_swapped=swap_space.num_swapped if swap_space else 0,
        prefix_host_blocks_total=host.blocks_total if host else 0,
        prefix_host_blocks_used=host.blocks_used if host else 0,
        prefix_host_hit_blocks=host.hit_blocks if host else 0,
        prefix_host_offloaded_blocks=host.offloaded_blocks if host else 0,
        prefix_host_dropped_blocks=host.dropped_blocks if host else 0,
        prefix_host_bytes_to_host=host.bytes_to_host if host else 0,
        prefix_host_bytes_to_device=host.bytes_to_device if host else 0,
        prefix_host_copy_seconds=host.copy_seconds if host else 0.0,
        **_disk_fields(host.disk if host else None),
    )


def _disk_fields(disk: DiskTierStats | None) -> dict[str, int]:
    if disk is None:
        return {}
    return {
        "prefix_disk_blocks_total": disk.blocks_total,
        "prefix_disk_blocks_used": disk.files,
        "prefix_disk_hit_blocks": disk.hit_blocks,
        "prefix_disk_written_blocks": disk.written_blocks,
        "prefix_disk_dropped_blocks": disk.dropped_blocks,
        "prefix_disk_corrupt_blocks": disk.corrupt_blocks,
        "prefix_disk_bytes_read": disk.bytes_read,
        "prefix_disk_bytes_written": disk.bytes_written,
    }


class PrometheusExporter:
    """Publishes :class:`CacheStats` through ``prometheus_client`` (``pip install
    -e '.[metrics]'`` in the checkout). Call :meth:`update` once per step; counters advance by the
    difference since the last update."""

    def __init__(self, namespace: str = "kvcache", registry: Any = None):
        try:
            import prometheus_client as prom
        except ImportError as err:
            raise ImportError(
                "PrometheusExporter needs prometheus_client: pip install -e '.[metrics]' in the project checkout"
            ) from err
        kw: dict[str, Any] = {"namespace": namespace}
        if registry is not None:
            kw["registry"] = registry
        self.usage = prom.Gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", **kw)
        self.blocks = prom.Gauge("kv_cache_blocks", "KV-cache blocks by state.", ["state"], **kw)
        self.queries = prom.Counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", **kw)
        self.hits = prom.Counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", **kw)
        self.evictions = prom.Counter("prefix_cache_evictions", "Cached blocks evicted for reuse.", **kw)
        self.preemptions = prom.Counter("num_preemptions", "Sequences preempted, by mode.", ["mode"], **kw)
        self.swapped = prom.Counter("swapped_blocks", "Blocks copied by swap, by direction.", ["direction"], **kw)
        tiered = ["tier"]
        self.tier_blocks = prom.Gauge(
            "prefix_cache_tier_blocks", "Blocks of a lower prefix-cache tier.", [*tiered, "state"], **kw
        )
        self.tier_hits = prom.Counter(
            "prefix_cache_tier_hit_blocks", "Blocks admission took from a lower tier.", tiered, **kw
        )
        self.tier_blocks_moved = prom.Counter(
            "prefix_cache_tier_blocks_moved", "Blocks a lower tier took in or dropped.", [*tiered, "event"], **kw
        )
        self.tier_bytes = prom.Counter(
            "prefix_cache_tier_bytes", "K/V bytes copied to or from a lower tier.", ["tier", "direction"], **kw
        )
        self.tier_copy_seconds = prom.Counter(
            "prefix_cache_tier_copy_seconds", "Time the copies of a lower tier took.", ["tier"], **kw
        )
        self._last: CacheStats | None = None

    def update(self, stats: CacheStats) -> None:
        last = self._last
        self.usage.set(stats.usage)
        for state, value in (
            ("used", stats.blocks_used),
            ("free", stats.blocks_free),
            ("cached", stats.blocks_cached),
            ("cached_free", stats.blocks_cached_free),
        ):
            self.blocks.labels(state=state).set(value)

        def delta(name: str) -> int:
            now = getattr(stats, name)
            return max(0, now - (getattr(last, name) if last is not None else 0))

        self.queries.inc(delta("prefix_cache_queries"))
        self.hits.inc(delta("prefix_cache_hits"))
        self.evictions.inc(delta("prefix_cache_evictions"))
        self.preemptions.labels(mode="recompute").inc(delta("preemptions_recompute"))
        self.preemptions.labels(mode="swap").inc(delta("preemptions_swap"))
        self.swapped.labels(direction="out").inc(delta("swapped_out_blocks"))
        self.swapped.labels(direction="in").inc(delta("swapped_in_blocks"))
        if stats.prefix_host_blocks_total:
            self.tier_blocks.labels(tier="host", state="total").set(stats.prefix_host_blocks_total)
            self.tier_blocks.labels(tier="host", state="used").set(stats.prefix_host_blocks_used)
        self.tier_hits.labels(tier="host").inc(delta("prefix_host_hit_blocks"))
        self.tier_blocks_moved.labels(tier="host", event="offloaded").inc(delta("prefix_host_offloaded_blocks"))
        self.tier_blocks_moved.labels(tier="host", event="dropped").inc(delta("prefix_host_dropped_blocks"))
        self.tier_bytes.labels(tier="host", direction="to_host").inc(delta("prefix_host_bytes_to_host"))
        self.tier_bytes.labels(tier="host", direction="to_device").inc(delta("prefix_host_bytes_to_device"))
        if stats.prefix_disk_blocks_total:
            self.tier_blocks.labels(tier="disk", state="total").set(stats.prefix_disk_blocks_total)
            self.tier_blocks.labels(tier="disk", state="used").set(stats.prefix_disk_blocks_used)
        self.tier_hits.labels(tier="disk").inc(delta("prefix_disk_hit_blocks"))
        self.tier_blocks_moved.labels(tier="disk", event="written").inc(delta("prefix_disk_written_blocks"))
        self.tier_blocks_moved.labels(tier="disk", event="dropped").inc(delta("prefix_disk_dropped_blocks"))
        self.tier_blocks_moved.labels(tier="disk", event="corrupt").inc(delta("prefix_disk_corrupt_blocks"))
        self.tier_bytes.labels(tier="disk", direction="to_disk").inc(delta("prefix_disk_bytes_written"))
        self.tier_bytes.labels(tier="disk", direction="from_disk").inc(delta("prefix_disk_bytes_read"))
        now_s, last_s = stats.prefix_host_copy_seconds, last.prefix_host_copy_seconds if last is not None else 0.0
        self.tier_copy_seconds.labels(tier="host").inc(max(0.0, now_s - last_s))
        self._last = stats
