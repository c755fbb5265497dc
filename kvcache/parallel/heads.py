"""Tensor parallelism: which attention heads, and so which K/V, each rank owns.

The rule, in one place (everything else asks :class:`TensorParallel`):

* query heads are split evenly: ``size`` must divide ``num_heads``; rank ``r`` owns the
  contiguous heads ``[r * H/size, (r+1) * H/size)``;
* KV heads, when ``size <= num_kv_heads``: ``size`` must divide ``num_kv_heads``; rank ``r``
  owns the contiguous KV heads ``[r * KVH/size, (r+1) * KVH/size)``;
* KV heads, when ``size > num_kv_heads``: ``num_kv_heads`` must divide ``size``; each rank
  holds one KV head, ``r // (size / num_kv_heads)``, replicated on ``size / num_kv_heads``
  ranks (as vLLM does: a KV head cannot be split, so it is copied).

Both cases agree with GQA: query head ``h`` reads KV head ``h // (H/KVH)``, and every query
head of rank ``r`` maps to a KV head rank ``r`` holds (``tests/test_tensor_parallel.py``
checks it for every small shape). So each rank's backend serves an ordinary
:class:`~attention.AttentionSpec` of its own heads, and each rank's cache holds
``kv_heads_per_rank`` heads of every block: the same block ids on every rank, smaller blocks.

Torch-free: ``kvcache plan --tp N`` uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attention.checks import require_int
from attention.errors import InvalidArgumentError
from attention.spec import AttentionSpec

__all__ = ["HeadShard", "TensorParallel", "head_problems", "rank_spec", "valid_tp_sizes"]

#: Most ranks a tensor-parallel group may have (a bound for argument checks, far above use).
MAX_TP_SIZE = 4096


def head_problems(num_heads: int, num_kv_heads: int, size: int) -> list[str]:
    """Why ``size`` ranks cannot split ``num_heads`` query / ``num_kv_heads`` KV heads, each
    reason with the sizes that would work; empty when they can."""
    found = []
    if num_heads % size:
        found.append(f"{num_heads} query heads do not split evenly over {size} ranks")
    if size <= num_kv_heads and num_kv_heads % size:
        found.append(f"{num_kv_heads} KV heads do not split evenly over {size} ranks")
    if size > num_kv_heads and size % num_kv_heads:
        found.append(
            f"{size} ranks cannot replicate {num_kv_heads} KV heads evenly (with more ranks than KV heads, "
            f"the rank count must be a multiple of the KV heads)"
        )
    if found:
        *most, last = (str(s) for s in valid_tp_sizes(num_heads, num_kv_heads))
        sizes = f"{', '.join(most)} or {last}" if most else last
        found[-1] += f"; use a tensor-parallel size of {sizes}"
    return found


def valid_tp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every tensor-parallel size that splits these heads (divisors of ``num_heads`` that
    divide ``num_kv_heads`` or are multiples of it)."""
    return [
        s
        for s in range(1, num_heads + 1)
        if num_heads % s == 0 and (num_kv_heads % s == 0 if s <= num_kv_heads else s % num_kv_heads == 0)
    ]


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank owns, as global head indices.

    query_heads: its query heads (contiguous).
    kv_heads:    the KV heads it holds (contiguous; one head when replicated).
    kv_replicas: how many ranks hold each of its KV heads (1: not replicated).
    """

    query_heads: range
    kv_heads: range
    kv_replicas: int

    def kv_head_of(self, query_head: int) -> int:
        """The local index (into :attr:`kv_heads`) of the KV head global ``query_head`` reads
        on this rank, by the local GQA rule ``local_q // (local H / local KVH)``."""
        local = self.query_heads.index(query_head)
        return local // (len(self.query_heads) // len(self.kv_heads))


@dataclass(frozen=True)
class TensorParallel:
    """One rank of a tensor-parallel group: ``size`` ranks, this one ``rank``.

    ``TensorParallel()`` is the single-rank default (no sharding). Raises
    ArgumentTypeError / InvalidArgumentError naming the field.
    """

    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        require_int("tp.size", self.size, minimum=1, maximum=MAX_TP_SIZE)
        require_int("tp.rank", self.rank, minimum=0)
        if self.rank >= self.size:
            raise InvalidArgumentError(
                f"tp.rank: {self.rank} is not a rank of a group of {self.size} (0 to {self.size - 1})"
            )

    @property
    def is_sharded(self) -> bool:
        return self.size > 1

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Raise InvalidArgumentError when this group cannot split the heads (the message
        gives the sizes that can)."""
        problems = head_problems(num_heads, num_kv_heads, self.size)
        if problems:
            raise InvalidArgumentError(f"tensor-parallel size {self.size}: " + "; ".join(problems))

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads in each rank's cache (the same on every rank). Does not check divisibility."""
        return max(num_kv_heads // self.size, 1)

    def kv_replicas(self, num_kv_heads: int) -> int:
        """Ranks holding each KV head: 1, or ``size / num_kv_heads`` when replicated."""
        return max(self.size // num_kv_heads, 1)

    def shard(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """The heads this rank owns. Raises InvalidArgumentError when the heads do not split."""
        self.check_heads(num_heads, num_kv_heads)
        per_rank = num_heads // self.size
        replicas = self.kv_replicas(num_kv_heads)
        kv_per_rank = self.kv_heads_per_rank(num_kv_heads)
        first_kv = (self.rank // replicas) * kv_per_rank
        return HeadShard(
            query_heads=range(self.rank * per_rank, (self.rank + 1) * per_rank),
            kv_heads=range(first_kv, first_kv + kv_per_rank),
            kv_replicas=replicas,
        )


def rank_spec(spec: AttentionSpec, tp: TensorParallel) -> AttentionSpec:
    """The attention shape rank ``tp.rank`` serves: its query heads and KV heads, everything
    else (head_dim, dtypes, window, scale) unchanged. Raises InvalidArgumentError when the
    heads do not split over ``tp.size`` ranks."""
    shard = tp.shard(spec.num_heads, spec.num_kv_heads)
    if not tp.is_sharded:
        return spec
    return dataclasses.replace(spec, num_heads=len(shard.query_heads), num_kv_heads=len(shard.kv_heads))
