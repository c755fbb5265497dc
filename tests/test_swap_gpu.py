"""CPU swap of a CUDA cache: side-stream copies are ordered after queued work, device blocks
stay held until their copy has read them, and the round trip is bit-identical.

Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from kvcache import BlockManager, KVCacheTensors, SwapSpace

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_swap_round_trip_on_cuda_is_bit_identical_and_ordered() -> None:
    manager = BlockManager(64, 32)
    cache = KVCacheTensors(torch.randn(4, 2, 64, 32, 8, 128, device="cuda").to(torch.bfloat16))
    space = SwapSpace(manager, cache, num_host_blocks=32)
    assert space.host.is_pinned()
    manager.allocate("a", 20 * 32 + 5)  # 21 blocks
    manager.allocate("b", 32)
    blocks = manager.block_table("a")
    # Queued, not yet run when swap_out is called: the copy must see these values.
    big = torch.randn(4, 2, len(blocks), 32, 8, 128, device="cuda").to(torch.bfloat16)
    for _ in range(20):
        big = big * 1  # keep the compute stream busy ahead of the write
    cache.storage[:, :, blocks] = big
    expected = big.clone()

    space.swap_out("a")
    assert "a" not in manager and space.is_swapped("a")
    assert manager.num_free_blocks == 64 - 22, "a's blocks must stay held while the copy is in flight"
    manager.check_integrity()  # held blocks are counted as owned
    space.synchronize()  # the copy has read them: they return to the pool
    assert manager.num_free_blocks == 64 - 1
    manager.check_integrity()

    manager.allocate("c", 40 * 32)  # reuses a's old blocks
    cache.storage[:, :, manager.block_table("c")] = float("nan")
    manager.free("c")
    space.swap_in("a")
    torch.cuda.synchronize()
    got = cache.storage[:, :, manager.block_table("a")]
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    manager.check_integrity()
    assert space.integrity_problems() == []
