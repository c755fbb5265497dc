"""Capacity planning: how many blocks, tokens and sequences a config gives, before allocating.

Answers the question users otherwise learn from an OOM: what does this budget hold?
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.config import KVCacheConfig
from kvcache.sizes import format_bytes

__all__ = ["CapacityPlan", "plan_capacity"]


@dataclass(frozen=True)
class CapacityPlan:
    """Capacity figures for one config. ``free_bytes`` is the device memory assumed free
    (None when the config gives num_blocks and no memory was given)."""

    bytes_per_block: int
    bytes_per_token: int
    num_blocks: int
    block_size: int
    free_bytes: int | None
    max_seq_len: int | None

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_sequence(self) -> int | None:
        return None if self.max_seq_len is None else -(-self.max_seq_len // self.block_size)

    @property
    def sequences_that_fit(self) -> int | None:
        """Sequences of ``max_seq_len`` tokens held at once (each needs whole blocks)."""
        per_seq = self.blocks_per_sequence
        return None if per_seq is None else self.num_blocks // per_seq

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.cache_bytes <= self.free_bytes

    def lines(self) -> list[tuple[str, str]]:
        rows = [
            ("bytes per block", f"{self.bytes_per_block:,} ({format_bytes(self.bytes_per_block)})"),
            ("bytes per token", f"{self.bytes_per_token:,} ({format_bytes(self.bytes_per_token)})"),
            ("block size", f"{self.block_size} tokens"),
            ("blocks", f"{self.num_blocks:,}"),
            ("token capacity", f"{self.token_capacity:,} tokens"),
            ("cache size", format_bytes(self.cache_bytes)),
        ]
        if self.free_bytes is not None:
            rows.insert(0, ("device memory assumed free", format_bytes(self.free_bytes)))
        if self.max_seq_len is not None:
            rows.append((f"sequences of {self.max_seq_len:,} tokens",
                         f"{self.sequences_that_fit:,} at once ({self.blocks_per_sequence} blocks each)"))
        return rows


def plan_capacity(config: KVCacheConfig, free_bytes: int | None, max_seq_len: int | None = None) -> CapacityPlan:
    """Plan ``config`` for ``free_bytes`` of free device memory.

    With ``num_blocks`` in the config, ``free_bytes`` only decides whether it fits. With a
    fractional ``memory_budget`` it is required (raises ValueError naming --memory).
    """
    cache = config.cache
    if cache.num_blocks is not None:
        blocks = cache.num_blocks
    else:
        assert cache.memory_budget is not None, "the config validator requires one of them"
        if cache.memory_budget.num_bytes is not None:
            budget = cache.memory_budget.num_bytes
            if free_bytes is not None:
                budget = min(budget, free_bytes)
        elif free_bytes is None:
            raise ValueError(
                f"--memory: cache.memory_budget is {cache.memory_budget}, so planning needs the "
                f"device's free memory; pass e.g. --memory 80GiB"
            )
        else:
            budget = cache.memory_budget.bytes_given(free_bytes)
        blocks = budget // config.bytes_per_block
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"--max-seq-len: {max_seq_len} must be at least 1")
    return CapacityPlan(
        bytes_per_block=config.bytes_per_block,
        bytes_per_token=config.bytes_per_token,
        num_blocks=blocks,
        block_size=cache.block_size,
        free_bytes=free_bytes,
        max_seq_len=max_seq_len,
    )
