"""The overlapped serving loop (step N+1 scheduled while step N runs, sampled tokens fed on
the device) generates exactly the tokens of the sequential loop, through chunked prefill,
preemption (recompute and swap, which drain the step in flight first) and prefix caching
(whose blocks are keyed once the deferred token ids arrive)."""

from __future__ import annotations

import pytest
import torch

from examples.decode_loop import VOCAB_SIZE
from examples.engine import Engine, engine_for
from examples.engine.loop import RunReport, run_requests
from examples.engine.scheduler import Request, make_preemption
from examples.engine.workload import make_workload
from examples.model import random_llama, shape_for_cache
from kvcache import load_config


def serve(
    overlap: bool,
    workload: str,
    preempt: str,
    prefix_caching: bool,
    stops: list[frozenset[int]] | None = None,
) -> tuple[list[Request], RunReport, Engine]:
    """The tiny-cpu workload through the loop (``stops``: each request's stop token ids)."""
    torch.set_num_threads(1)
    config = load_config("tiny-cpu")
    shape = shape_for_cache(config.model, vocab_size=VOCAB_SIZE)
    engine = engine_for(config, shape, prefix_caching=prefix_caching)
    model = random_llama(shape, seed=3)
    requests = make_workload(workload, 14, seed=5, block_size=config.cache.block_size, vocab_size=VOCAB_SIZE)
    for req, stop in zip(requests, stops or [], strict=False):
        req.stop_token_ids = stop
    report = run_requests(
        model,
        requests,
        manager=engine.manager,
        cache=engine.cache,
        backend=engine.backend,
        preemption=make_preemption(preempt, engine.manager, engine.cache, config.cache.swap_space),
        token_budget=40,
        overlap=overlap,
        record_margins=True,
    )
    return requests, report, engine


@pytest.mark.parametrize(
    ("workload", "preempt", "prefix_caching"),
    [("default", "recompute", False), ("default", "swap", True), ("shared-prefix", "recompute", True)],
)
def test_overlapped_loop_generates_the_sequential_tokens(workload: str, preempt: str, prefix_caching: bool) -> None:
    sequential, seq_report, _ = serve(False, workload, preempt, prefix_caching)
    overlapped, report, _ = serve(True, workload, preempt, prefix_caching)
    assert [r.output for r in overlapped] == [r.output for r in sequential]
    assert all(r.is_finished and r.in_flight == 0 for r in overlapped)
    assert seq_report.fed_rows == 0 and not seq_report.overlap
    assert report.fed_rows > 0, "no step was scheduled before its predecessor's tokens were known"
    if workload == "default":
        assert report.preemptions >= 1, "tiny-cpu is sized so the example preempts"
    if prefix_caching and workload == "shared-prefix":
        assert report.prefix_hit_tokens
