"""Capacity planning: how many blocks, tokens and sequences a config gives, before allocating.

Answers the question users otherwise learn from an OOM: what does this budget hold? A plan
that holds nothing says so (:meth:`CapacityPlan.problems`), never a quiet 0.

With tensor parallelism (``tp_size`` ranks) every figure is per rank, except the total cache
size: each rank holds every block id, each block holding that rank's KV heads, so the token
capacity is the same on every rank and for the whole group, while a rank's bytes per block
shrink with its share of the heads (and stop shrinking once KV heads are replicated).
"""

from __future__ import annotations

from dataclasses import dataclass

from attention.checks import require_int
from attention.dtypes import DTYPES
from attention.errors import InvalidArgumentError
from kvcache.blocks.groups import KVGroupLayout
from kvcache.config.rules import MAX_TOKENS
from kvcache.config.safe_read import printable
from kvcache.config.schema import KVCacheConfig
from kvcache.config.sizes import format_bytes
from kvcache.parallel.heads import MAX_TP_SIZE, TensorParallel, head_problems

__all__ = ["CapacityPlan", "plan_capacity"]


@dataclass(frozen=True)
class CapacityPlan:
    """Capacity figures for one config. ``free_bytes`` is the device memory assumed free
    (None when the config gives num_blocks and no memory was given); ``budget`` says where
    the block count comes from. With ``tp_size`` > 1, bytes, blocks and free memory are one
    rank's (``query_heads``/``kv_heads``: per rank; ``kv_replicas``: ranks holding each KV
    head)."""

    bytes_per_block: int
    bytes_per_token: int
    num_blocks: int
    block_size: int
    free_bytes: int | None
    max_seq_len: int | None
    budget: str = ""
    tp_size: int = 1
    query_heads: int = 0
    kv_heads: int = 0
    kv_replicas: int = 1
    host_blocks: int = 0
    disk_blocks: int = 0
    disk_dir: str | None = None
    groups: KVGroupLayout | None = None
    #: How a scaled cache (fp8, int8) stores its scales, and what they cost ("" otherwise).
    scales: str = ""

    @property
    def group_block_ids(self) -> int:
        """Block ids of the pool the KV groups share (a hybrid layout): the same memory, each
        id holding ``groups.group_size`` layers' K/V instead of every layer's."""
        if self.groups is None:
            return self.num_blocks
        return self.num_blocks * self.groups.num_layers // self.groups.group_size

    def group_blocks_per_sequence(self, seq_len: int) -> int:
        """Block ids one sequence of ``seq_len`` tokens holds over every group at its peak (a
        windowed group keeps the blocks its last window touches, at most
        ``ceil((window - 1) / block_size) + 1``); without groups, ``ceil(seq_len / block_size)``."""
        if self.groups is None:
            return -(-seq_len // self.block_size)
        return sum(self._ids_per_sequence(seq_len, group.window) for group in self.groups.groups)

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def cache_bytes(self) -> int:
        """One rank's cache (the whole cache without tensor parallelism)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def total_cache_bytes(self) -> int:
        """The cache of every rank together."""
        return self.tp_size * self.cache_bytes

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
        """Whether the cache fits in the memory assumed free."""
        return self.free_bytes is None or self.cache_bytes <= self.free_bytes

    def problems(self) -> list[str]:
        """Why this plan cannot serve, each with a fix; empty when it can: no block fits the
        budget, the cache does not fit in free memory, or no sequence of max_seq_len fits
        (with KV groups: its block ids over every group, as the hybrid manager holds them)."""
        found = []
        per_block = format_bytes(self.bytes_per_block)
        if self.num_blocks == 0:
            found.append(
                f"no block fits: {self.budget or 'the budget'} holds no block of {per_block}; give more memory "
                f"(--memory, cache.memory_budget) or make blocks smaller (block_size, dtype)"
            )
        elif not self.fits:
            found.append(
                f"the cache does not fit: {self.num_blocks:,} blocks x {per_block} = {format_bytes(self.cache_bytes)} "
                f"exceeds the {format_bytes(self.free_bytes or 0)} assumed free; lower cache.num_blocks "
                f"to at most {(self.free_bytes or 0) // self.bytes_per_block:,}"
            )
        if self.num_blocks > 0 and self.max_seq_len is not None:
            found += self._sequence_problems(self.max_seq_len)
        return found

    def _sequence_problems(self, seq_len: int) -> list[str]:
        """Why no sequence of ``seq_len`` tokens fits (empty when one does)."""
        longest = self._longest_sequence()
        lower = f"; give more memory or lower --max-seq-len to at most {longest:,}" if longest else "; give more memory"
        if self.groups is not None:
            need = self.group_blocks_per_sequence(seq_len)
            if need <= self.group_block_ids:
                return []
            return [
                f"no sequence of {_count(seq_len, 'token')} fits: with KV groups it needs {_count(need, 'block id')} "
                f"and the cache holds {self.group_block_ids:,}{lower}"
            ]
        need = -(-seq_len // self.block_size)
        if need <= self.num_blocks:
            return []
        return [
            f"no sequence of {_count(seq_len, 'token')} fits: it needs {_count(need, 'block')} and the cache "
            f"holds {self.num_blocks:,} ({_count(self.token_capacity, 'token')}){lower}"
        ]

    def _longest_sequence(self) -> int:
        """The most tokens one sequence can hold when it has the whole cache (with KV groups: the
        longest whose block ids over every group fit; 0 when not even one token's do)."""
        if self.groups is None:
            return self.token_capacity
        low, high = 0, self.group_block_ids  # blocks of a full-attention group's table
        while low < high:  # the need grows with the length: bisect
            mid = (low + high + 1) // 2
            if self.group_blocks_per_sequence(mid * self.block_size) <= self.group_block_ids:
                low = mid
            else:
                high = mid - 1
        return low * self.block_size

    def lines(self) -> list[tuple[str, str]]:
        sharded = self.tp_size > 1
        each = " per rank" if sharded else ""
        blocks_note = " per rank (the same block ids on every rank)" if sharded else ""
        tokens_note = " (each rank holds its heads of every token)" if sharded else ""
        total = f" per rank, {format_bytes(self.total_cache_bytes)} in all {self.tp_size} ranks" if sharded else ""
        rows = [
            ("bytes per block", f"{self.bytes_per_block:,} ({format_bytes(self.bytes_per_block)}){each}"),
            ("bytes per token", f"{self.bytes_per_token:,} ({format_bytes(self.bytes_per_token)}){each}"),
            *([("scales", self.scales)] if self.scales else []),
            ("block size", f"{self.block_size} tokens"),
            ("blocks", f"{self.num_blocks:,}{blocks_note}"),
            ("token capacity", f"{self.token_capacity:,} tokens{tokens_note}"),
            ("cache size", format_bytes(self.cache_bytes) + total),
        ]
        if self.free_bytes is not None:
            rows.insert(0, ("device memory assumed free", format_bytes(self.free_bytes) + each))
        if sharded:
            replicated = f" (each KV head on {self.kv_replicas} ranks)" if self.kv_replicas > 1 else ""
            rows.insert(
                0,
                (
                    "tensor parallel",
                    f"{self.tp_size} ranks: {_heads(self.query_heads, 'query')} and "
                    f"{_heads(self.kv_heads, 'KV')} per rank{replicated}",
                ),
            )
        if self.host_blocks:
            rows.append(
                (
                    "prefix cache, host tier",
                    f"{self.host_blocks:,} blocks, {self.host_blocks * self.block_size:,} tokens, "
                    f"{format_bytes(self.host_blocks * self.bytes_per_block)} pinned host memory{each}",
                )
            )
        if self.disk_blocks:
            rows.append(
                (
                    "prefix cache, disk tier",
                    f"{self.disk_blocks:,} blocks, {self.disk_blocks * self.block_size:,} tokens, "
                    f"{format_bytes(self.disk_blocks * self.bytes_per_block)} of files under "
                    f"{printable(self.disk_dir or '')}{each}",
                )
            )
        if self.max_seq_len is not None:
            one_table = " with one block table for every layer" if self.groups is not None else ""
            rows.append(
                (
                    f"sequences of {_count(self.max_seq_len, 'token')}",
                    f"{self.sequences_that_fit:,} at once ({_count(self.blocks_per_sequence or 0, 'block')} each)"
                    f"{one_table}",
                )
            )
        if self.groups is not None:
            rows += self._group_lines()
        return rows

    def _group_lines(self) -> list[tuple[str, str]]:
        """Per-group rows of a hybrid layout: what KV groups (kvcache.HybridBlockManager) hold."""
        assert self.groups is not None, "called for a hybrid layout only"
        g = self.groups
        per_id = self.bytes_per_block * g.group_size // g.num_layers
        rows = [
            (
                "KV groups",
                f"{len(g.groups)}, one block id = {g.group_size} layers' K/V ({format_bytes(per_id)}); "
                f"{self.group_block_ids:,} ids in the same memory",
            )
        ]
        for window in dict.fromkeys(group.window for group in g.groups):
            kind = [group for group in g.groups if group.window == window]
            layers = sum(len(group.layers) for group in kind)
            name = "full" if window is None else f"window {window:,}"
            text = f"{len(kind)} group{'s' if len(kind) > 1 else ''}, {layers} layers"
            if self.max_seq_len is not None:
                ids = self._ids_per_sequence(self.max_seq_len, window)
                text += (
                    f"; a sequence of {_count(self.max_seq_len, 'token')} holds {_count(ids, 'id')} per group, "
                    f"{format_bytes(ids * per_id * len(kind))} in all"
                )
            rows.append((f"  {name}", text))
        if self.max_seq_len is not None:
            per_seq = self.group_blocks_per_sequence(self.max_seq_len)
            rows.append(
                (
                    f"sequences of {_count(self.max_seq_len, 'token')}, KV groups",
                    f"{self.group_block_ids // per_seq:,} at once ({per_seq:,} block ids, "
                    f"{format_bytes(per_seq * per_id)} each)",
                )
            )
        return rows

    def _ids_per_sequence(self, seq_len: int, window: int | None) -> int:
        """Block ids one group of this window holds for a sequence of ``seq_len`` tokens."""
        full = -(-seq_len // self.block_size)
        return full if window is None else min(full, -(-(window - 1) // self.block_size) + 1)


def _heads(n: int, kind: str) -> str:
    return f"{n} {kind} head{'s' if n != 1 else ''}"


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``1 token``, ``1,024 blocks``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def plan_capacity(
    config: KVCacheConfig, free_bytes: int | None, max_seq_len: int | None = None, tp_size: int = 1
) -> CapacityPlan:
    """Plan ``config`` for ``free_bytes`` of free device memory (per device).

    With ``num_blocks`` in the config, ``free_bytes`` only decides whether it fits. With a
    fractional ``memory_budget`` it is required. ``tp_size``: plan one rank of that many
    tensor-parallel ranks (the budget and free memory are per rank). Raises
    InvalidArgumentError (a ValueError) naming ``--memory``, ``--max-seq-len`` or ``--tp``
    (a size that does not split the heads, with the sizes that do). A plan that holds nothing
    is returned, with :meth:`CapacityPlan.problems` saying why.
    """
    tp_size = require_int("--tp", tp_size, minimum=1, maximum=MAX_TP_SIZE)
    m = config.model
    split = head_problems(m.num_heads, m.num_kv_heads, tp_size)
    if split:
        raise InvalidArgumentError(f"--tp {tp_size}: " + "; ".join(split))
    tp = TensorParallel(tp_size)
    if free_bytes is not None and (isinstance(free_bytes, bool) or not isinstance(free_bytes, int) or free_bytes < 0):
        raise InvalidArgumentError(f"--memory: {free_bytes!r} is not a byte count; give e.g. 80GiB")
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= MAX_TOKENS
    ):
        raise InvalidArgumentError(f"--max-seq-len: {max_seq_len!r} must be a whole number in [1, {MAX_TOKENS}]")
    blocks, budget = _blocks(config, free_bytes, tp)
    return CapacityPlan(
        bytes_per_block=config.bytes_per_block_per_rank(tp),
        bytes_per_token=config.bytes_per_token_per_rank(tp),
        num_blocks=blocks,
        block_size=config.cache.block_size,
        free_bytes=free_bytes,
        max_seq_len=max_seq_len,
        budget=budget,
        tp_size=tp_size,
        query_heads=m.num_heads // tp_size,
        kv_heads=tp.kv_heads_per_rank(m.num_kv_heads),
        kv_replicas=tp.kv_replicas(m.num_kv_heads),
        host_blocks=config.cache.host_cache_space // config.bytes_per_block_per_rank(tp),
        disk_blocks=config.cache.disk_cache_space // config.bytes_per_block_per_rank(tp),
        disk_dir=config.cache.disk_cache_dir,
        groups=_hybrid_groups(config),
        scales=_scales_line(config, tp),
    )


def _scales_line(config: KVCacheConfig, tp: TensorParallel) -> str:
    """What a scaled cache's scales cost: int8 keeps an fp16 scale per token and KV head in
    its blocks (counted in the bytes per token above); fp8 one fp32 scale per layer and KV head
    beside the cache. Says so when K and V are stored rotated (no bytes: the rotation is one
    head_dim x head_dim matrix for the whole cache)."""
    info = DTYPES[config.cache.dtype]
    if not info.cache_only:
        return ""
    m = config.model
    rotated = "; K and V stored rotated (cache.kv_rotation: hadamard)" if config.cache.kv_rotation != "none" else ""
    if info.token_scales:
        per_token = config.bytes_per_token_per_rank(tp)
        values = 2 * m.num_layers * config.kv_heads_per_rank(tp) * m.head_dim
        return (
            f"fp16 per token and KV head, in the blocks (padded to whole rows): {per_token - values:,} of the "
            f"{per_token:,} bytes per token{rotated}"
        )
    heads = 1 if m.latent_dim is not None else config.kv_heads_per_rank(tp)
    return f"fp32 per layer and KV head, beside the blocks: {2 * m.num_layers * heads * 4:,} bytes in all{rotated}"


def _hybrid_groups(config: KVCacheConfig) -> KVGroupLayout | None:
    """The KV groups of a model mixing full and windowed layers (None for one kind only)."""
    return config.kv_groups()


def _blocks(config: KVCacheConfig, free_bytes: int | None, tp: TensorParallel) -> tuple[int, str]:
    """The pool's block count, and a phrase naming the budget it comes from."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks, f"cache.num_blocks {cache.num_blocks:,}"
    budget = cache.memory_budget
    if budget is None:
        raise InvalidArgumentError("config: cache has neither num_blocks nor memory_budget; validate it first")
    if budget.num_bytes is not None:
        usable = budget.num_bytes if free_bytes is None else min(budget.num_bytes, free_bytes)
        phrase = f"the budget {budget}" + ("" if free_bytes is None else f" (of {format_bytes(free_bytes)} free)")
    elif free_bytes is None:
        raise InvalidArgumentError(
            f"--memory: cache.memory_budget is {budget}, so planning needs the "
            f"device's free memory; pass e.g. --memory 80GiB"
        )
    else:
        usable = budget.bytes_given(free_bytes)
        phrase = f"the budget {budget} ({format_bytes(usable)} of {format_bytes(free_bytes)})"
    return usable // config.bytes_per_block_per_rank(tp), phrase
