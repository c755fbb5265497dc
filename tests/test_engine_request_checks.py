"""A bad request is refused when it is handed over (``Scheduler.submit``, ``run_requests``),
naming the request and the field, with nothing changed: the requests already running go on
to produce the tokens they produce alone. A run that fails midway gives its blocks back, so
the same manager serves the same ids again."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from attention.errors import ArgumentTypeError, InvalidArgumentError
from examples.engine import Engine, engine_for
from examples.engine.loop import StepPipeline, run_requests
from examples.engine.runner import ModelRunner
from examples.engine.scheduler import Preemption, Request, Scheduler, SwapPreemption, make_preemption
from examples.model import Llama, random_llama, shape_for_cache, shape_from_config
from kvcache import StepCapacity, load_config

VOCAB = 256


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.set_num_threads(1)
    return random_llama(shape_for_cache(load_config("tiny-cpu").model, vocab_size=VOCAB), seed=0)


def _engine(num_blocks: int | None = None) -> Engine:
    config = load_config("tiny-cpu")
    return engine_for(config, shape_for_cache(config.model, vocab_size=VOCAB), num_blocks=num_blocks)


def _run(
    model: Llama, engine: Engine, requests: list[Request], preemption: Preemption | None = None, **kw: Any
) -> None:
    run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=preemption or make_preemption("recompute", engine.manager, engine.cache), **kw,
    )  # fmt: skip


def _good() -> Request:
    return Request(1, list(range(20)), max_new_tokens=6)


def _online(model: Llama, bad: Request | None) -> tuple[Request, Exception | None]:
    """Run ``_good()`` through a scheduler, submitting ``bad`` after two steps; return the
    good request when done and what ``submit`` raised (None: nothing)."""
    engine = _engine()
    m = engine.manager
    good = _good()
    scheduler = Scheduler(m, [good], make_preemption("recompute", m, engine.cache), token_budget=64)
    runner = ModelRunner(model, engine.cache, m, engine.backend, StepCapacity(16, 64, 24))
    pipeline = StepPipeline(runner, scheduler, overlap=False)  # gives the scheduler the model's vocabulary
    error: Exception | None = None
    for step in range(60):
        if step == 2 and bad is not None:
            state = (good.num_computed, good.in_flight, list(good.output), len(scheduler.waiting))
            with pytest.raises((ArgumentTypeError, InvalidArgumentError)) as info:
                scheduler.submit(bad)
            error = info.value
            assert (good.num_computed, good.in_flight, good.output, len(scheduler.waiting)) == state
        if scheduler.done:
            break
        batch = scheduler.schedule(step)
        if batch is not None:
            pipeline.submit(batch)
    assert scheduler.done and m.num_sequences == 0
    m.check_integrity()
    return good, error


ONLINE_CASES: dict[str, tuple[Callable[[], Request], str]] = {
    "duplicate id": (lambda: Request(1, [5, 6, 7], 3), "request 1: req_id: 1 is already taken"),
    "out of vocab": (lambda: Request(2, [5, 999, 7], 3), "request 2: prompt[1]: token id 999 is outside"),
    "negative id": (lambda: Request(2, [-1], 3), "request 2: prompt[0]: token id -1 is outside"),
    "empty prompt": (lambda: Request(3, [], 3), "request 3: prompt: is empty"),
    "no new tokens": (lambda: Request(4, [1, 2], 0), "request 4: max_new_tokens: 0 is below the minimum 1"),
    "negative new tokens": (lambda: Request(4, [1, 2], -5), "request 4: max_new_tokens: -5"),
    "new tokens None": (lambda: Request(4, [1, 2], None), "request 4: max_new_tokens: expected an int"),  # type: ignore[arg-type]
    "prompt a str": (lambda: Request(5, "hello", 3), "request 5: prompt: expected a list"),  # type: ignore[arg-type]
    "prompt a tensor": (lambda: Request(5, torch.tensor([1, 2]), 3), "prompt.tolist()"),  # type: ignore[arg-type]
    "float token": (lambda: Request(5, [1, 1.5], 3), "request 5: prompt[1]: expected an int token id"),  # type: ignore[list-item]
    "stop ids an int": (lambda: Request(6, [1], 3, stop_token_ids=5), "request 6: stop_token_ids"),  # type: ignore[arg-type]
    "id not an int": (lambda: Request(None, [1], 3), "request None: req_id: expected an int"),  # type: ignore[arg-type]
    "too long for the pool": (lambda: Request(7, [1] * 700, 200), "request 7: 700 prompt + 200 new tokens need 29"),
}


@pytest.mark.parametrize("case", list(ONLINE_CASES))
def test_a_bad_online_request_is_refused_at_submit_and_the_others_go_on(model: Llama, case: str) -> None:
    make, message = ONLINE_CASES[case]
    alone, _ = _online(model, None)
    good, error = _online(model, make())
    assert message in str(error)
    assert good.output == alone.output and good.finish_step is not None


def test_submit_refuses_an_id_the_manager_already_holds(model: Llama) -> None:
    engine = _engine()
    m = engine.manager
    m.allocate(9, token_ids=[1, 2, 3])
    scheduler = Scheduler(m, [], make_preemption("recompute", m, engine.cache), vocab_size=VOCAB)
    with pytest.raises(InvalidArgumentError, match="request 9: req_id: in the block manager, sequence 9 already has"):
        scheduler.submit(Request(9, [1, 2], 3))
    assert not scheduler.waiting


def test_an_id_is_free_again_once_its_request_finished(model: Llama) -> None:
    engine = _engine()
    first, second = Request(3, [1, 2, 3], 2), Request(3, [4, 5], 2)
    _run(model, engine, [first])
    _run(model, engine, [second])
    assert len(first.output) == len(second.output) == 2


@pytest.mark.parametrize(("prompt", "index", "token"), [([1, 256, 3], 1, 256), ([-1], 0, -1), ([2**40], 0, 2**40)])
def test_run_requests_refuses_token_ids_outside_the_vocabulary(
    model: Llama, prompt: list[int], index: int, token: int
) -> None:
    engine = _engine()
    with pytest.raises(InvalidArgumentError) as info:
        _run(model, engine, [Request(0, [4, 5], 3), Request(1, prompt, 3)])
    assert f"request 1: prompt[{index}]: token id {token} is outside the model's vocabulary [0, 256)" in str(info.value)
    assert engine.manager.num_sequences == 0 and engine.manager.num_free_blocks == engine.manager.num_blocks


def test_run_requests_refuses_duplicate_ids_before_anything_runs(model: Llama) -> None:
    engine = _engine()
    first = Request(7, [1] * 40, 10)
    with pytest.raises(InvalidArgumentError, match="request 7: req_id: 7 is already taken"):
        _run(model, engine, [first, Request(7, [4] * 40, 10, arrival_step=3)])
    assert engine.manager.num_sequences == 0 and first.num_computed == 0 and not first.output
    again = Request(7, [1] * 40, 10)
    _run(model, engine, [again])  # the id was never taken
    assert len(again.output) == 10


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_run_that_fails_midway_gives_its_blocks_back(model: Llama, preempt: str, overlap: bool) -> None:
    # 8 blocks for 6 requests of 2-3 blocks each: some are preempted (swapped out) while others run.
    engine = _engine(num_blocks=8)
    m = engine.manager
    swap_space = load_config("tiny-cpu").cache.swap_space
    preemption = make_preemption(preempt, m, engine.cache, swap_space)

    def requests() -> list[Request]:
        return [Request(i, [(7 * i + j) % VOCAB for j in range(40 + 5 * i)], 30) for i in range(6)]

    def fail(step: int, scheduler: Scheduler, elapsed: float, generated: int) -> None:
        held = scheduler.num_preemptions > 0 and m.num_sequences > 0  # blocks on the device
        if isinstance(preemption, SwapPreemption):
            held = held and preemption.space.swapped_out_blocks > preemption.space.swapped_in_blocks  # and host
        if held:
            raise RuntimeError("a progress hook failed")

    with pytest.raises(RuntimeError, match="a progress hook failed"):
        _run(model, engine, requests(), preemption, overlap=overlap, on_step=fail, token_budget=32)
    assert m.num_sequences == 0 and m.num_free_blocks == m.num_blocks
    if isinstance(preemption, SwapPreemption):  # nothing left on the host either
        assert preemption.space.allocator.num_free == preemption.space.allocator.num_blocks
    m.check_integrity()
    again = requests()
    preemption = make_preemption(preempt, m, engine.cache, swap_space)
    _run(model, engine, again, preemption, overlap=overlap, token_budget=32)  # the same ids
    assert all(len(r.output) == 30 for r in again)


def test_a_request_past_the_models_positions_is_refused(model: Llama) -> None:
    engine = _engine()
    short = random_llama(replace(model.shape, max_positions=64), seed=0)
    with pytest.raises(InvalidArgumentError) as info:
        _run(short, engine, [Request(0, [1] * 10, 5), Request(1, [1] * 60, 5)])
    assert "request 1: 60 prompt + 5 new tokens exceed the model's 64 positions (max_position_embeddings)" in str(
        info.value
    )
    assert engine.manager.num_sequences == 0
    fits = Request(1, [1] * 59, 5)  # 64 positions exactly
    _run(short, engine, [fits])
    assert len(fits.output) == 5


def test_a_checkpoint_config_gives_the_models_positions() -> None:
    config = {
        "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    }  # fmt: skip
    assert shape_from_config(config).max_positions is None  # no limit known
    assert shape_from_config({**config, "max_position_embeddings": 32}).max_positions == 32


def _small_runner(model: Llama, engine: Engine, capacity: StepCapacity) -> ModelRunner:
    return ModelRunner(model, engine.cache, engine.manager, engine.backend, capacity)


def test_an_online_request_longer_than_the_runners_tables_is_refused_at_submit(model: Llama) -> None:
    # The pool (24 blocks of 32) holds 768 tokens, the runner's tables 4 blocks: 128 tokens.
    engine = _engine()
    m = engine.manager
    good = _good()
    scheduler = Scheduler(m, [good], make_preemption("recompute", m, engine.cache), token_budget=64)
    pipeline = StepPipeline(_small_runner(model, engine, StepCapacity(16, 64, 4)), scheduler, overlap=False)
    assert scheduler.max_request_tokens == 4 * m.block_size
    for step in range(60):
        if step == 2:
            with pytest.raises(InvalidArgumentError) as info:
                scheduler.submit(Request(2, list(range(100)), 30))  # 129 tokens at its peak
            assert "request 2: 100 prompt + 30 new tokens reach 129 tokens but the runner's sequences hold at " \
                   "most 128 (StepCapacity.max_blocks_per_seq x block_size)" in str(info.value)  # fmt: skip
            assert not scheduler.waiting
            scheduler.submit(Request(3, list(range(100)), 29))  # 128: fits exactly
        if scheduler.done:
            break
        batch = scheduler.schedule(step)
        if batch is not None:
            pipeline.submit(batch)
    assert scheduler.done and len(good.output) == 6 and m.num_sequences == 0
    assert [len(r.output) for r in scheduler.finished if r.req_id == 3] == [29]


def test_a_pipeline_refuses_a_scheduler_its_runner_cannot_hold(model: Llama) -> None:
    engine = _engine()
    m = engine.manager
    preemption = make_preemption("recompute", m, engine.cache)
    runner = _small_runner(model, engine, StepCapacity(8, 32, 4))
    cases = [
        (Scheduler(m, [], preemption, token_budget=32, max_running=9), "max_running 9 and token_budget 32 exceed"),
        (Scheduler(m, [], preemption, token_budget=33, max_running=8), "max_running 8 and token_budget 33 exceed"),
        (Scheduler(m, [Request(4, [1] * 120, 10)], preemption, token_budget=32, max_running=8),
         "request 4: 120 prompt + 10 new tokens reach 129 tokens"),
    ]  # fmt: skip
    for scheduler, message in cases:
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            StepPipeline(runner, scheduler, overlap=False)
        assert scheduler.drain is None and scheduler.vocab_size is None and scheduler.max_request_tokens is None
    fits = Scheduler(m, [], preemption, token_budget=32, max_running=8, max_request_tokens=1000)
    StepPipeline(runner, fits, overlap=False)
    assert fits.max_request_tokens == 128  # the runner's, the smaller
