"""Requests that stop at a stop token (an end-of-sequence id): the output ends with the first
stop token generated, as ``generate(eos_token_id=...)`` ends, in the sequential and the
overlapped loop (where the request's next row is already in flight when its stop token
becomes known: that row's token is discarded and the blocks are freed after it), through
preemption and prefix caching."""

from __future__ import annotations

import random

import pytest

from examples.decode_loop import VOCAB_SIZE
from examples.engine.scheduler import Request
from tests.test_overlap import serve


def _stops_from(plain: list[Request]) -> tuple[list[frozenset[int]], list[list[int]]]:
    """Per request a stop token taken from its plain output (or none), and the output the
    request must then produce: the plain one up to and including its first occurrence."""
    rng = random.Random(11)
    stops, expected = [], []
    for req in plain:
        if req.req_id % 4 == 3:  # some requests have no stop token they reach
            stops.append(frozenset({VOCAB_SIZE + 7}))
            expected.append(req.output)
            continue
        token = req.output[rng.randrange(len(req.output))]
        stops.append(frozenset({token}))
        expected.append(req.output[: req.output.index(token) + 1])
    return stops, expected


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("preempt", "prefix_caching"), [("recompute", False), ("swap", True)])
def test_a_request_ends_at_its_first_stop_token(overlap: bool, preempt: str, prefix_caching: bool) -> None:
    plain, _, _ = serve(False, "default", preempt, prefix_caching)
    stops, expected = _stops_from(plain)
    assert any(len(e) < len(r.output) for e, r in zip(expected, plain, strict=True))
    stopped, report, engine = serve(overlap, "default", preempt, prefix_caching, stops)
    assert [r.output for r in stopped] == expected
    assert all(r.is_finished and r.in_flight == 0 for r in stopped)
    assert [r.stopped for r in stopped] == [e[-1] in s for e, s in zip(expected, stops, strict=True)]
    assert report.finished == len(stopped)
    assert engine.manager.num_sequences == 0  # every request's blocks were freed (the loop checked integrity)
    if overlap:
        assert report.fed_rows > 0


def test_kept_output_stops_at_the_first_stop_token_and_the_budget() -> None:
    req = Request(0, [1, 2], max_new_tokens=5, stop_token_ids=frozenset({9}))
    assert req.kept_output([3, 9, 4, 9]) == ([3, 9], True)
    assert req.kept_output([3, 4, 5, 6, 7, 8]) == ([3, 4, 5, 6, 7], False)
    assert req.output == [] and not req.stopped  # nothing changed
    assert req.append_output([3, 4]) == [3, 4] and not req.is_finished
    assert req.append_output([9, 5]) == [9] and req.stopped and req.is_finished and req.fully_sampled
