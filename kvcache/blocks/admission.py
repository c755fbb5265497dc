"""What admitting a prompt takes: its length, the cached blocks it can share and the free
blocks it needs, computed once for both ``can_allocate`` and ``allocate`` so that the check
and the action cannot disagree."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

from attention.checks import cdiv
from attention.errors import ArgumentTypeError
from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.digest import encode_salt
from kvcache.blocks.prefix_cache import BlockKey, PrefixCache
from kvcache.blocks.tiers import LowerTier
from kvcache.blocks.tokens import prompt_length

__all__ = ["Admission", "checked_prompt", "plan_admission"]


class Admission(NamedTuple):
    """A checked prompt and what it takes from the pool (changes nothing until acted on).

    num_tokens: its length.
    token_ids:  its ids as a list, kept when prefix caching will key its blocks (else None).
    hits:       cached full blocks it shares, in order from its first block.
    keys:       the prefix-cache keys of ``hits``.
    needed:     free blocks it takes: its new blocks (lower-tier hits included), plus hits
                waiting in the free queue.
    lower_keys: the keys of the blocks after ``hits`` that a lower tier holds, in order.
    lower:      their handles in that tier.
    """

    num_tokens: int
    token_ids: list[int] | None
    hits: list[int]
    keys: list[BlockKey]
    needed: int
    lower_keys: list[BlockKey]
    lower: list[int]


def checked_prompt(
    num_tokens: object, token_ids: object, extra_key: Hashable, *, cached: bool
) -> tuple[int, list[int] | None]:
    """A prompt's length and (when ``cached``: prefix caching keys its blocks) its ids as a
    list, its salt checked. Raises InvalidArgumentError / ArgumentTypeError naming the
    argument."""
    length, tokens = prompt_length(num_tokens, token_ids, keep=cached)
    try:
        hash(extra_key)
    except TypeError:
        raise ArgumentTypeError(f"extra_key: {type(extra_key).__name__} is not hashable") from None
    if cached:
        encode_salt(extra_key)  # refuses a salt without a stable encoding, naming extra_key
    return length, tokens


def plan_admission(
    allocator: BlockAllocator,
    prefix_cache: PrefixCache | None,
    block_size: int,
    num_tokens: object,
    token_ids: object,
    extra_key: Hashable,
    lower_tier: LowerTier | None = None,
) -> Admission:
    """Check a prompt given as a count and/or its ids and find its prefix hits. Raises
    InvalidArgumentError / ArgumentTypeError naming the argument; changes nothing."""
    length, tokens = checked_prompt(num_tokens, token_ids, extra_key, cached=prefix_cache is not None)
    hits: list[int] = []
    keys: list[BlockKey] = []
    if prefix_cache is not None and tokens:
        # Match over all tokens but the last: its logits are needed, so it is always computed.
        hits, keys = prefix_cache.match(tokens, extra_key, limit=len(tokens) - 1)
    lower_keys: list[BlockKey] = []
    lower: list[int] = []
    if lower_tier is not None and tokens:
        parent = keys[-1] if keys else None
        for i in range(len(hits), (len(tokens) - 1) // block_size):
            key = BlockKey(parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra_key)
            handle = lower_tier.lookup(key)
            if handle is None:
                break
            lower_keys.append(key)
            lower.append(handle)
            parent = key
    revived = allocator.count_free(hits)
    return Admission(length, tokens, hits, keys, cdiv(length, block_size) - len(hits) + revived, lower_keys, lower)
