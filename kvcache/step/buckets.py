"""The fixed step shapes (buckets) a serving loop pads its steps to, so CUDA graphs can be
captured for them and every launch of a bucket is the same.

- A *decode* step (every row brings one token) of ``n`` rows is padded to the smallest decode
  bucket ``B >= n``: ``B`` rows and ``B`` tokens, one per row.
- A *mixed* step (some row brings more: a prompt or a chunk of one, beside decode rows) of
  ``t`` tokens is padded to the smallest token bucket ``T >= t``: ``T`` tokens and
  ``min(max_rows, T - 1)`` rows. A mixed step of ``t`` tokens has at most ``t - 1`` rows (one
  row has two tokens or more), so it always fits; and the bucket has more tokens than rows,
  which is how a backend's graph plan knows it must launch its prefill kernel.

Mixed buckets exist only for a backend with ``mixed_cuda_graphs``. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attention.errors import InvalidArgumentError

__all__ = ["StepBuckets", "StepShape", "default_buckets", "default_token_buckets"]

#: Token buckets grow in steps of this many tokens up to TOKEN_STEP_UNTIL, then by about
#: TOKEN_GROWTH (rounded up to a multiple of TOKEN_STEP): below a few hundred tokens a step is
#: memory-bound and padding is nearly free; above, each padding token costs compute.
TOKEN_STEP = 32
TOKEN_STEP_UNTIL = 256
TOKEN_GROWTH = 1.25
#: Largest default token bucket: past it a step's device time (about 25 ms for an 8B model at
#: 1024 tokens on an H200) already exceeds the host time of launching it eagerly.
MAX_GRAPH_TOKENS = 1024


def default_buckets(max_rows: int) -> list[int]:
    """Decode buckets: 1, 2, 4, ... below ``max_rows``, then ``max_rows``."""
    buckets, b = [], 1
    while b < max_rows:
        buckets.append(b)
        b *= 2
    return [*buckets, max_rows]


def default_token_buckets(max_tokens: int, limit: int = MAX_GRAPH_TOKENS) -> list[int]:
    """Mixed-step token buckets: every TOKEN_STEP tokens up to TOKEN_STEP_UNTIL, then about
    TOKEN_GROWTH x apart, up to ``min(max_tokens, limit)`` (which is the last one)."""
    top = min(max_tokens, limit)
    buckets, t = [], TOKEN_STEP
    while t < top:
        buckets.append(t)
        if t < TOKEN_STEP_UNTIL:
            t += TOKEN_STEP
        else:
            t = -(-int(t * TOKEN_GROWTH) // TOKEN_STEP) * TOKEN_STEP
    return [*buckets, top] if top >= 2 else []


@dataclass(frozen=True)
class StepShape:
    """A bucket: the rows and tokens a step is padded to. ``mixed``: room for prefill rows
    (padding rows bring no token; plan with ``pad_tokens=tokens``)."""

    rows: int
    tokens: int

    @property
    def mixed(self) -> bool:
        return self.tokens > self.rows


class StepBuckets:
    """The decode buckets and mixed-step token buckets of one engine (module docstring).

    max_rows:      the builder's row capacity (the largest decode bucket's rows).
    decode:        decode buckets (rows); default :func:`default_buckets`; ``()``: none (a
                   step of one token per row then has no bucket).
    tokens:        mixed-step token buckets; default none. Each must be in [2, max_tokens].
    max_tokens:    the builder's token capacity.
    """

    def __init__(
        self,
        max_rows: int,
        max_tokens: int,
        *,
        decode: Sequence[int] | None = None,
        tokens: Sequence[int] = (),
    ):
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.decode = tuple(sorted(set(default_buckets(max_rows) if decode is None else decode)))
        if self.decode and (self.decode[0] < 1 or self.decode[-1] > max_rows):
            raise InvalidArgumentError(f"buckets: {list(self.decode)} must lie in [1, max_rows={max_rows}]")
        self.tokens = tuple(sorted(set(tokens)))
        if self.tokens and (self.tokens[0] < 2 or self.tokens[-1] > max_tokens):
            raise InvalidArgumentError(f"token_buckets: {list(self.tokens)} must lie in [2, max_tokens={max_tokens}]")

    def shapes(self) -> list[StepShape]:
        """Every bucket, largest first (the order graphs sharing one memory pool are captured)."""
        mixed = [self.mixed_shape(t) for t in self.tokens]
        plain = [StepShape(b, b) for b in self.decode]
        return sorted(mixed + plain, key=lambda s: (s.tokens, s.rows), reverse=True)

    def mixed_shape(self, tokens: int) -> StepShape:
        return StepShape(min(self.max_rows, tokens - 1), tokens)

    def shape_for(self, query_lens: Sequence[int]) -> StepShape | None:
        """The bucket of a step whose rows bring ``query_lens`` tokens (None: no bucket holds
        it; the step runs unpadded)."""
        rows = len(query_lens)
        if rows == 0:
            return None
        tokens = sum(query_lens)
        if tokens == rows:  # every row brings one token
            b = next((b for b in self.decode if b >= rows), None)
            return None if b is None else StepShape(b, b)
        t = next((t for t in self.tokens if t >= tokens), None)
        return None if t is None or rows > self.max_rows else self.mixed_shape(t)
