"""Requests that stop at a stop token (an end-of-sequence id): the output ends with the first
stop token generated, as ``generate(eos_token_id=...)`` ends, in the sequential and the
overlapped loop (where the request's next row is already in flight when its stop token
becomes known: that row's token is discarded and the blocks are freed after it), through
preemption and prefix caching."""

from __future__ import annotations

import random

import pytest
import torch

from examples.decode_loop import VOCAB_SIZE
from examples.engine.loop import run_requests
from examples.engine.parts import engine_for
from examples.engine.scheduler import Request, make_preemption
from examples.model.llama import random_llama
from examples.model.shape import shape_for_cache
from kvcache import KVCacheConfig, load_config
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


@pytest.mark.parametrize("num_blocks", [4, 5, 6])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_token_applied_while_making_room_ends_the_request(num_blocks: int, overlap: bool) -> None:
    """A full pool: a request's next row needs a block, so the overlapped loop first applies
    the step in flight, whose token for that very request is a stop token. The request ends
    there (its blocks freed), and the scheduler goes on without it; it used to look the
    freed sequence up and crash with UnknownSequenceError."""
    torch.set_num_threads(1)
    base = load_config("tiny-cpu")
    config = KVCacheConfig.model_validate(
        {**base.model_dump(), "cache": {**base.cache.model_dump(), "num_blocks": num_blocks}}, strict=False
    )
    shape = shape_for_cache(config.model, vocab_size=VOCAB_SIZE)
    engine = engine_for(config, shape, num_blocks=num_blocks)
    rng = random.Random(num_blocks)
    block = config.cache.block_size  # prompts of one whole block: the first decode token needs a new one
    every_token = frozenset(range(VOCAB_SIZE))
    requests = [
        Request(i, [rng.randrange(VOCAB_SIZE) for _ in range(block)], 5, stop_token_ids=every_token) for i in range(4)
    ]
    report = run_requests(
        random_llama(shape, seed=0),
        requests,
        manager=engine.manager,
        cache=engine.cache,
        backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache, config.cache.swap_space),
        token_budget=4 * block,
        max_running=4,
        overlap=overlap,
    )
    assert [len(r.output) for r in requests] == [1, 1, 1, 1] and all(r.stopped for r in requests)
    assert report.finished == 4 and engine.manager.num_sequences == 0
    assert engine.manager.num_free_blocks == num_blocks
