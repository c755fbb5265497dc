"""Shortening a sequence: the rollback of rejected draft tokens (speculative decoding).

A verifier appends ``k`` draft tokens, computes them, accepts the first ``a`` and takes the
rest back. Truncating to ``n`` tokens:

* releases the blocks wholly past position ``n`` (one owner fewer each; a full cached block
  stays indexed, its K/V is right for its key, and may serve a later request);
* keeps the keys of the blocks still full (``n // block_size``) and drops the rest from the
  record; their token ids come back from the keys, so the blocks key again once refilled;
* makes the new last block, when ``n`` ends inside it, safe to write again: a block that
  others share (a prefix hit, a fork, a hold) is replaced by a fresh copy (returned, for the
  caller to perform, as :meth:`BlockManager.fork` does); one this sequence alone owns is
  taken out of the prefix index, since its tail is about to be overwritten;
* clamps the computed and planned counts to ``n``; pending (deferred) ids past ``n`` go.

Tokens behind a sliding window cannot come back: ``n`` must stay past the released blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from attention.checks import require_int
from attention.errors import InvalidArgumentError
from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.sequence import SequenceBlocks

__all__ = ["TruncationPlan", "plan_truncation"]


@dataclass(frozen=True)
class TruncationPlan:
    """What truncating one sequence to ``num_tokens`` does (nothing done yet).

    keep_blocks: leading table entries kept (``ceil(num_tokens / block_size)``).
    keep_keys:   leading block keys kept (the blocks still full and keyed).
    rewrite:     the kept last block, when it is partly filled after the cut and was full or
                 keyed before (None otherwise).
    copy:        whether ``rewrite`` is shared and must be replaced by a fresh copy (needs
                 one free block); otherwise it is only taken out of the prefix index.
    """

    num_tokens: int
    keep_blocks: int
    keep_keys: int
    rewrite: int | None
    copy: bool

    @property
    def blocks_needed(self) -> int:
        return 1 if self.copy else 0


def plan_truncation(
    seq: SequenceBlocks, seq_id: object, num_tokens: object, block_size: int, allocator: BlockAllocator
) -> TruncationPlan:
    """Check ``num_tokens`` for ``seq`` and plan the cut. Raises ArgumentTypeError for a
    non-integer, InvalidArgumentError for a length that is not in ``[1, seq.num_tokens]`` or
    that reaches into blocks released behind the sliding window. Changes nothing."""
    n = require_int("num_tokens", num_tokens)
    if not 1 <= n <= seq.num_tokens:
        raise InvalidArgumentError(
            f"num_tokens: {n} for sequence {seq_id!r:.60}, which holds {seq.num_tokens} tokens; truncation keeps "
            f"between 1 and {seq.num_tokens} (append_slots grows a sequence, free ends it)"
        )
    first_held = seq.num_released * block_size
    if n <= first_held:
        raise InvalidArgumentError(
            f"num_tokens: {n} for sequence {seq_id!r:.60}, whose first {first_held} tokens are released behind "
            f"its sliding window; keep more than {first_held}, or free it and recompute"
        )
    keep_blocks = -(-n // block_size)
    keep_keys = min(len(seq.keys), n // block_size)
    rewrite = None
    copy = False
    if n % block_size and n < seq.num_tokens:
        last = seq.blocks[keep_blocks - 1]
        # Was this block full before the cut (maybe shared, maybe keyed)? Then its tail will be
        # written again; a block that was already partly filled is private and unkeyed.
        if seq.num_tokens >= keep_blocks * block_size:
            rewrite = last
            copy = allocator.ref_count(last) > 1
    return TruncationPlan(n, keep_blocks, keep_keys, rewrite, copy)


def cut_token_ids(seq: SequenceBlocks, plan: TruncationPlan, block_size: int) -> None:
    """Set ``seq``'s token ids, base and pending count for ``plan.num_tokens`` tokens; the
    ids of blocks whose keys are dropped come back from those keys."""
    n = plan.num_tokens
    known_end = seq.num_tokens - seq.num_pending  # ids known for positions [token_base, known_end)
    seq.num_pending = max(0, n - known_end)
    if seq.token_ids is None:
        return
    base = min(seq.token_base, plan.keep_keys * block_size)
    restored = [t for key in seq.keys[base // block_size : seq.token_base // block_size] for t in key.tokens]
    ids = restored + seq.token_ids
    seq.token_ids = ids[: min(n, known_end) - base]
    seq.token_base = base
