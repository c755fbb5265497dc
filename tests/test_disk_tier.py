"""The disk tier of the prefix cache (``kvcache.memory.disk_tier``): block files named by digest,
checked whole when read (a damaged, short, swapped or missing file is deleted and its block
recomputed, never served), bounded LRU, salted, published as events; and below the host tier,
admission continues a prompt's run from disk. The end-to-end check that damaged files cost no
wrong token is ``test_bench_tiers.py``."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kvcache import (
    BlockManager,
    BlockRemoved,
    BlockStored,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheTensors,
    PrometheusExporter,
    collect_stats,
    plan_capacity,
)
from kvcache.blocks.prefix_cache import BlockKey
from kvcache.memory.disk_tier import DiskPrefixTier, layout_name
from kvcache.memory.host_tier import ON_DISK, HostPrefixTier
from tests.test_host_tier import BS, computed, evict_all, kv

SHAPE = (2, 2, BS, 1, 3)


def key(*ids: int, salt: object = None) -> BlockKey:
    return BlockKey(None, tuple(ids), salt)


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def disk(folder: Path, files: int = 8) -> DiskPrefixTier:
    probe = DiskPrefixTier(folder / "probe", 1 << 20, SHAPE, torch.float32)
    return DiskPrefixTier(folder, files * probe.file_bytes, SHAPE, torch.float32)


def test_a_block_comes_back_bit_for_bit_from_a_file_named_by_its_digest(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    k, data = key(1, 2, 3, 4), block(0)
    tier.store(k, data)
    waiting = tier.read(k)  # before the writer gets to it: from memory
    assert waiting is not None and torch.equal(waiting, data)
    tier.flush()
    path = tier.path_of(k)
    assert path.name == k.digest.hex() + ".kv" and path.parent == tier.folder
    assert tier.folder.parent.name == layout_name(SHAPE, torch.float32) and tier.folder.name.startswith("run-")
    assert path.stat().st_size == tier.file_bytes
    back = tier.read(k)
    assert back is not None and torch.equal(back, data)
    assert tier.read(key(1, 2, 3, 5)) is None  # never stored: a miss, not a damaged file
    stats = tier.stats()
    assert (stats.files, stats.hit_blocks, stats.written_blocks, stats.corrupt_blocks) == (1, 2, 1, 0)
    assert stats.bytes_written == data.numel() * 4


def damage_payload(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x01  # one bit of the payload
    path.write_bytes(bytes(raw))


def truncate_file(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def damage_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF  # the magic
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [damage_payload, truncate_file, damage_header, Path.unlink])
def test_a_damaged_or_missing_file_is_never_served(tmp_path: Path, damage: object) -> None:
    tier = disk(tmp_path)
    k = key(5, 6, 7, 8)
    tier.store(k, block(1))
    tier.flush()  # written by the background thread
    damage(tier.path_of(k))  # type: ignore[operator]
    assert tier.read(k) is None
    assert not tier.holds(k) and not tier.path_of(k).exists()
    assert tier.stats().corrupt_blocks == 1 and tier.stats().hit_blocks == 0
    assert tier.read(k) is None and tier.stats().corrupt_blocks == 1  # forgotten: a plain miss now


def test_a_file_under_another_blocks_name_is_refused(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    a, b = key(1, 1, 1, 1), key(2, 2, 2, 2)
    tier.store(a, block(2))
    tier.store(b, block(3))
    tier.flush()
    shutil.copyfile(tier.path_of(a), tier.path_of(b))  # a valid file, but of another block
    assert tier.read(b) is None and tier.stats().corrupt_blocks == 1
    back = tier.read(a)
    assert back is not None and torch.equal(back, block(2))


def test_the_tier_is_bounded_and_deletes_the_least_recently_used_file(tmp_path: Path) -> None:
    tier = disk(tmp_path, files=3)
    keys = [key(i, i, i, i) for i in range(4)]
    for i, k in enumerate(keys[:3]):
        tier.store(k, block(i))
    assert tier.read(keys[0]) is not None  # now the most recently used
    tier.store(keys[3], block(3))
    tier.flush()
    assert [tier.holds(k) for k in keys] == [True, False, True, True]
    assert not tier.path_of(keys[1]).exists()
    assert len(list(tier.folder.glob("*.kv"))) == 3 and tier.stats().dropped_blocks == 1
    assert tier.integrity_problems() == []


def test_an_earlier_runs_files_are_deleted_and_other_layouts_left_alone(tmp_path: Path) -> None:
    """A tier whose process is gone (here: its lock released without a clean close) leaves
    files that the next tier on the directory deletes, with the block files an older version
    wrote straight into the layout folder; other folders and files are left alone."""
    first = disk(tmp_path)
    first.store(key(9, 9, 9, 9), block(9))
    first.flush()
    assert first.path_of(key(9, 9, 9, 9)).exists()
    assert first._claim is not None
    first._claim.close()  # its process exits: the lock goes, the files stay
    legacy = first.layout_folder / (key(8, 8, 8, 8).digest.hex() + ".kv")
    legacy.write_bytes(b"an older layout's file")
    other = tmp_path / "someone-elses.kv"
    other.write_bytes(b"not ours")
    second = disk(tmp_path)
    assert not first.folder.exists() and not legacy.exists()
    assert not second.holds(key(9, 9, 9, 9)) and list(second.folder.glob("*.kv")) == []
    assert other.exists()  # outside the layout folder: untouched


def test_a_folder_left_half_claimed_is_deleted_once_stale(tmp_path: Path) -> None:
    """A tier that died between making its folder and renaming it left ``.run-*.new``: the
    next tier deletes it once it is older than a claim takes, and leaves a fresh one (another
    process may be claiming it right now)."""
    first = disk(tmp_path)
    stale = first.layout_folder / ".run-1-deadbeef.new"
    fresh = first.layout_folder / ".run-2-cafef00d.new"
    for folder in (stale, fresh):
        folder.mkdir()
        (folder / ".lock").write_bytes(b"")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    disk(tmp_path)
    assert not stale.exists() and fresh.exists()
    assert first.folder.exists()  # the live tier's own folder stays


def test_live_tiers_sharing_a_directory_keep_to_their_own_files(tmp_path: Path) -> None:
    """Two engines (say, two models of one layout) on one disk directory: the same digest (the
    same prompt) holds each one's own K/V, a new tier deletes neither's files, and one's
    bound never deletes the other's."""
    a, b = disk(tmp_path, files=2), disk(tmp_path, files=2)
    shared = key(1, 2, 3, 4)
    a.store(shared, block(1))
    b.store(shared, block(2))
    a.flush()
    b.flush()
    assert a.folder != b.folder and a.path_of(shared) != b.path_of(shared)
    c = disk(tmp_path, files=2)  # a third one starting: the live tiers' folders stay
    back_a, back_b = a.read(shared), b.read(shared)
    assert back_a is not None and torch.equal(back_a, block(1))
    assert back_b is not None and torch.equal(back_b, block(2))
    for i in range(3):  # b's bound drops its own least recently used file only
        b.store(key(i, i, i, 0), block(10 + i))
    b.flush()
    assert a.read(shared) is not None and a.stats().corrupt_blocks == 0
    assert not c.holds(shared)
    for tier in (a, b, c):
        tier.close()
    assert list((tmp_path / layout_name(SHAPE, torch.float32)).iterdir()) == []


def test_close_deletes_the_tiers_files_and_folder(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    tier.store(key(5, 5, 5, 5), block(5))
    tier.close()  # waits for the queued write first
    assert not tier.folder.exists() and tier.read(key(5, 5, 5, 5)) is None and tier.stats().files == 0
    tier.close()  # a second call does nothing
    again = disk(tmp_path)
    assert again.folder.exists() and again.folder != tier.folder


def test_construction_is_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="disk_cache_space"):
        DiskPrefixTier(tmp_path, 100, SHAPE, torch.float32)
    m = BlockManager(4, BS, enable_prefix_caching=True)
    cache = KVCacheTensors(torch.zeros(2, 2, 4, BS, 1, 3))
    with pytest.raises(InvalidArgumentError, match="disk_dir, disk_bytes"):
        HostPrefixTier(m, cache, 2, disk_bytes=1 << 20)
    with pytest.raises(InvalidArgumentError, match="disk_dir, disk_bytes"):
        HostPrefixTier(m, cache, 2, disk_dir=tmp_path)
    assert m.lower_tier is None  # nothing attached


def setup(tmp_path: Path, device_blocks: int, host_blocks: int) -> tuple[BlockManager, KVCacheTensors, HostPrefixTier]:
    m = BlockManager(device_blocks, BS, enable_prefix_caching=True)
    cache = KVCacheTensors(torch.zeros(2, 2, device_blocks, BS, 1, 3))
    tier = HostPrefixTier(m, cache, host_blocks, disk_dir=tmp_path, disk_bytes=1 << 20)
    return m, cache, tier


def spill_to_disk(m: BlockManager, tier: HostPrefixTier) -> None:
    """Evict every device block, then push every host block out to disk."""
    evict_all(m)
    for i in range(tier.num_host_blocks):  # unrelated blocks take the host pool's room
        ids = [10_000 + i * BS + j for j in range(BS + 1)]
        m.allocate("spill", token_ids=ids)
        m.mark_computed("spill", BS + 1)
        m.free("spill")
        evict_all(m)
    if tier.disk is not None:
        tier.disk.flush()


def test_admission_continues_the_run_from_disk_with_the_blocks_kv(tmp_path: Path) -> None:
    m, cache, tier = setup(tmp_path, device_blocks=6, host_blocks=2)
    prompt = list(range(300, 313))  # three full blocks + 1
    computed(m, cache, "a", prompt)
    want = kv(m, cache, "a", 12)
    m.free("a")
    spill_to_disk(m, tier)
    assert tier.disk is not None and tier.disk.stats().written_blocks >= 3
    first = BlockKey(None, tuple(prompt[:BS]), None)
    assert tier.lookup(first) == ON_DISK
    cache.storage.fill_(float("nan"))
    assert m.allocate("b", token_ids=prompt) == 12
    assert torch.equal(kv(m, cache, "b", 12), want)
    assert tier.disk.stats().hit_blocks == 3
    m.mark_computed("b", 13)
    m.check_integrity()
    assert tier.integrity_problems() == []
    assert collect_stats(m).prefix_disk_hit_blocks == 3


def test_a_damaged_file_ends_the_run_and_the_rest_is_recomputed(tmp_path: Path) -> None:
    m, cache, tier = setup(tmp_path, device_blocks=6, host_blocks=2)
    prompt = list(range(400, 413))
    computed(m, cache, "a", prompt)
    want = kv(m, cache, "a", 12)
    m.free("a")
    spill_to_disk(m, tier)
    assert tier.disk is not None
    second = BlockKey(BlockKey(None, tuple(prompt[:BS]), None), tuple(prompt[BS : 2 * BS]), None)
    damage_payload(tier.disk.path_of(second))
    cache.storage.fill_(float("nan"))
    assert m.allocate("b", token_ids=prompt) == BS  # the first block only
    assert torch.equal(kv(m, cache, "b", BS), want[:, :, :BS])
    assert tier.disk.stats().corrupt_blocks == 1
    assert m.sequence("b").keys == m.sequence("b").keys[:1]  # nothing past the damaged block is keyed
    m.check_integrity()
    # Recomputed and written again, the prompt's blocks are served as usual.
    for pos, slot in enumerate(m.slots("b", BS, len(prompt)), start=BS):
        cache.storage.view(2, 2, -1, 3)[:, :, slot] = want.view(2, 2, -1, 3)[:, :, pos] if pos < 12 else 0.0
    m.mark_computed("b", len(prompt))
    assert len(m.sequence("b").keys) == 3


def test_disk_events_and_salts(tmp_path: Path) -> None:
    m, cache, tier = setup(tmp_path, device_blocks=6, host_blocks=1)
    sub = m.kv_events.subscribe(replay=False)
    prompt = list(range(500, 509))
    computed(m, cache, "a", prompt, salt="tenant-a")
    m.free("a")
    spill_to_disk(m, tier)
    events = sub.poll()
    stored = {e.digest for e in events if isinstance(e, BlockStored) and e.tier == "disk"}
    mine = BlockKey(None, tuple(prompt[:BS]), "tenant-a")
    assert mine.digest in stored
    assert tier.lookup(BlockKey(None, tuple(prompt[:BS]), "tenant-b")) is None  # another salt: another file
    assert m.allocate("b", token_ids=prompt, extra_key="tenant-b") == 0
    m.free("b")
    late = m.kv_events.subscribe()
    replayed = {e.digest for e in late.poll() if isinstance(e, BlockStored) and e.tier == "disk"}
    assert tier.disk is not None
    assert mine.digest in replayed and replayed == {k.digest for k in tier.disk.held_keys()}
    damage_payload(tier.disk.path_of(mine))
    assert m.allocate("c", token_ids=prompt, extra_key="tenant-a") == 0
    removed = [e for e in late.poll() if isinstance(e, BlockRemoved) and e.tier == "disk"]
    assert [e.digest for e in removed] == [mine.digest]


def config_with(**cache: object) -> dict[str, object]:
    return {
        "model": {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64},
        "cache": {"block_size": 32, "num_blocks": 64, "enable_prefix_caching": True, **cache},
    }


@pytest.mark.parametrize(
    ("cache", "field", "words"),
    [
        ({"disk_cache_space": "1GiB", "host_cache_space": "64MiB"}, "disk_cache_space", "disk_cache_dir is not set"),
        ({"disk_cache_space": "1GiB", "disk_cache_dir": "/tmp/kv"}, "disk_cache_space", "no host tier"),
        ({"disk_cache_dir": "/tmp/kv", "host_cache_space": "64MiB"}, "disk_cache_dir", "without"),
        ({"disk_cache_space": -1}, "disk_cache_space", "negative"),
        ({"disk_cache_space": "lots"}, "disk_cache_space", "lots"),
        ({"disk_cache_dir": "   "}, "disk_cache_dir", "not a directory path"),
        ({"disk_cache_dir": "a\x00b"}, "disk_cache_dir", "not a directory path"),
    ],
)
def test_config_refuses_a_disk_tier_it_cannot_build(cache: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        KVCacheConfig.model_validate(config_with(**cache))
    text = str(err.value)
    assert field in text and words in text


def test_config_and_plan_show_the_disk_tier(tmp_path: Path) -> None:
    config = KVCacheConfig.model_validate(
        config_with(host_cache_space="64MiB", disk_cache_space="1GiB", disk_cache_dir=str(tmp_path))
    )
    rows = dict(plan_capacity(config, None).lines())
    per_block = config.bytes_per_block_per_rank()
    assert rows["prefix cache, disk tier"].startswith(f"{(1 << 30) // per_block:,} blocks")
    assert str(tmp_path) in rows["prefix cache, disk tier"]


def test_prometheus_reports_the_disk_tier(tmp_path: Path) -> None:
    prom = pytest.importorskip("prometheus_client")
    m, cache, tier = setup(tmp_path, device_blocks=6, host_blocks=1)
    computed(m, cache, "a", list(range(600, 609)))
    m.free("a")
    spill_to_disk(m, tier)
    registry = prom.CollectorRegistry()
    PrometheusExporter(registry=registry).update(collect_stats(m))
    written = registry.get_sample_value(
        "kvcache_prefix_cache_tier_blocks_moved_total", {"tier": "disk", "event": "written"}
    )
    assert tier.disk is not None and written == tier.disk.stats().written_blocks > 0


def test_a_full_write_queue_skips_blocks_instead_of_waiting(tmp_path: Path) -> None:
    probe = disk(tmp_path / "probe")
    tier = DiskPrefixTier(tmp_path, 8 * probe.file_bytes, SHAPE, torch.float32, max_pending_bytes=0)
    tier._pending[b"x" * 16] = b""  # one block waiting (never queued): the queue of one is full
    tier.store(key(3, 3, 3, 3), block(4))
    assert tier.stats().skipped_blocks == 1 and not tier.holds(key(3, 3, 3, 3))
