"""The prefix cache's host tier on a CUDA cache: an offload reads the block after the work
already queued has written it and before its new owner overwrites it; a load lands before the
step that reads it; the round trip is bit-identical. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcache import BlockManager, HostPrefixTier, KVCacheTensors
from kvcache.memory.host_tier import MIN_PITCHED_LOAD_ROW_BYTES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BS = 32


#: Both copy paths: rows on the copy engines (the default), and the staged gather.
COPY_PATHS = pytest.mark.parametrize("pitched", [True, False], ids=["pitched", "staged"])


def _tier(
    m: BlockManager, cache: KVCacheTensors, num_host_blocks: int, pitched: bool, **disk: object
) -> HostPrefixTier:
    tier = HostPrefixTier(m, cache, num_host_blocks, **disk)  # type: ignore[arg-type]
    assert tier.pitched_offloads, "cudaMemcpy2DAsync was not found in torch's CUDA runtime"
    assert tier.pitched_loads == (cache.bytes_per_block // (2 * cache.num_layers) >= MIN_PITCHED_LOAD_ROW_BYTES)
    tier.pitched_offloads = tier.pitched_loads = pitched
    return tier


@COPY_PATHS
def test_offload_and_load_are_ordered_with_the_compute_stream_and_bit_identical(pitched: bool) -> None:
    m = BlockManager(16, BS, enable_prefix_caching=True)
    cache = KVCacheTensors(torch.zeros(4, 2, 16, BS, 8, 128, device="cuda", dtype=torch.bfloat16))
    tier = _tier(m, cache, 32, pitched)
    assert tier.host.is_pinned()
    prompt = list(range(1000, 1000 + 4 * BS + 3))  # 4 full blocks
    m.allocate("a", token_ids=prompt)
    blocks = m.block_table("a")[:4]
    # Queued behind a busy stream, not yet run when the blocks are evicted: the offload must
    # read these values, not the zeros before them.
    values = torch.randn(4, 2, 4, BS, 8, 128, device="cuda").to(torch.bfloat16)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(30):
        busy = torch.tanh(busy @ busy)  # bounded: stays finite
    cache.storage[:, :, blocks] = values + (busy[0, 0] * 0).to(torch.bfloat16)
    m.mark_computed("a", len(prompt))
    m.free("a")
    m.allocate("b", 16 * BS)  # every block: a's four cached blocks are offloaded, then reused
    cache.storage.fill_(float("nan"))  # b's writes, queued right after the offload
    assert tier.stats().offloaded_blocks == 4
    m.free("b")
    assert m.allocate("c", token_ids=prompt) == 4 * BS  # from the host
    got = cache.storage[:, :, m.block_table("c")[:4]]  # read on the compute stream, after the load
    assert torch.equal(got, values)
    tier.synchronize()
    stats = tier.stats()
    assert stats.hit_blocks == 4 and stats.copy_seconds > 0
    m.check_integrity()
    assert tier.integrity_problems() == []


@COPY_PATHS
def test_blocks_spilled_to_disk_come_back_bit_identical(tmp_path: Path, pitched: bool) -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    cache = KVCacheTensors(torch.zeros(4, 2, 8, BS, 8, 128, device="cuda", dtype=torch.bfloat16))
    tier = _tier(m, cache, 2, pitched, disk_dir=tmp_path, disk_bytes=1 << 30)
    prompt = list(range(2000, 2000 + 4 * BS + 5))  # 4 full blocks
    m.allocate("a", token_ids=prompt)
    blocks = m.block_table("a")[:4]
    values = torch.randn(4, 2, 4, BS, 8, 128, device="cuda").to(torch.bfloat16)
    cache.storage[:, :, blocks] = values
    m.mark_computed("a", len(prompt))
    m.free("a")
    for i in range(3):  # evict a's blocks to the host, then push them on to disk
        m.allocate(("other", i), token_ids=[50_000 + 1000 * i + j for j in range(8 * BS)])
        m.mark_computed(("other", i), 8 * BS)
        m.free(("other", i))
    assert tier.disk is not None and tier.disk.stats().written_blocks >= 4
    cache.storage.fill_(float("nan"))
    assert m.allocate("c", token_ids=prompt) == 4 * BS  # every block from disk
    got = cache.storage[:, :, m.block_table("c")[:4]]
    assert torch.equal(got, values)
    m.free("c")
    m.check_integrity()
    assert tier.integrity_problems() == [] and tier.disk.stats().hit_blocks == 4
