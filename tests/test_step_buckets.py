"""The step buckets a serving loop pads its steps to (and captures CUDA graphs for): decode
buckets by rows, mixed-step buckets by tokens with fewer rows than tokens, and the default
token buckets."""

from __future__ import annotations

import itertools
import random

import pytest

from kvcache import InvalidArgumentError
from kvcache.step.buckets import StepBuckets, StepShape, default_buckets, default_token_buckets


def test_default_token_buckets_step_then_grow() -> None:
    assert default_token_buckets(256) == [32, 64, 96, 128, 160, 192, 224, 256]
    grown = default_token_buckets(8192)
    assert grown[:8] == [32, 64, 96, 128, 160, 192, 224, 256] and grown[-1] == 1024
    for low, high in itertools.pairwise(grown[7:]):
        assert high % 32 == 0 or high == 1024
        assert high <= low * 1.25 + 32, (low, high)
    assert default_token_buckets(100) == [32, 64, 96, 100]
    assert default_token_buckets(1) == []
    assert default_token_buckets(5000, limit=2048)[-1] == 2048


def test_every_step_gets_the_smallest_bucket_that_holds_it() -> None:
    """Random steps: a decode step gets the smallest decode bucket; a mixed step the smallest
    token bucket, with more tokens than rows and room for all its rows."""
    shapes = StepBuckets(64, 512, tokens=default_token_buckets(512))
    gen = random.Random(1)
    for _ in range(500):
        n = gen.randint(1, 64)
        decode = gen.random() < 0.4
        q_lens = [1] * n if decode else [1] * (n - 1) + [gen.randint(2, 512 - (n - 1))]
        shape = shapes.shape_for(q_lens)
        assert shape is not None
        tokens = sum(q_lens)
        if decode:
            b = min(b for b in default_buckets(64) if b >= n)
            assert shape == StepShape(b, b) and not shape.mixed
        else:
            assert shape.mixed and shape.tokens == min(t for t in shapes.tokens if t >= tokens)
            assert n <= shape.rows < shape.tokens


def test_steps_no_bucket_holds_run_unpadded() -> None:
    shapes = StepBuckets(8, 2048, tokens=[32, 64])
    assert shapes.shape_for([1, 70]) is None  # more tokens than the largest token bucket
    assert shapes.shape_for([]) is None
    assert StepBuckets(8, 64).shape_for([1, 5]) is None  # no token buckets: decode only
    assert StepBuckets(8, 64).shape_for([1] * 9) is None  # more rows than the largest bucket


def test_shapes_are_listed_largest_first_for_capture() -> None:
    shapes = StepBuckets(4, 64, tokens=[8, 64]).shapes()
    assert shapes == [StepShape(4, 64), StepShape(4, 8), StepShape(4, 4), StepShape(2, 2), StepShape(1, 1)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(decode=[0, 4]), "buckets"),
        (dict(decode=[9]), "max_rows"),
        (dict(tokens=[1, 8]), "token_buckets"),
        (dict(tokens=[128]), "max_tokens"),
    ],
)
def test_bad_buckets_are_refused(kwargs: dict[str, list[int]], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        StepBuckets(8, 64, **kwargs)  # type: ignore[arg-type]


def test_no_decode_buckets_leave_one_token_steps_unbucketed() -> None:
    """``decode=()`` (verification graphs): mixed buckets only."""
    shapes = StepBuckets(8, 64, decode=(), tokens=[16, 64])
    assert shapes.decode == ()
    assert shapes.shape_for([1, 1, 1]) is None
    assert shapes.shape_for([5, 5, 1]) == StepShape(8, 16)
    assert [s.tokens for s in shapes.shapes()] == [64, 16]
