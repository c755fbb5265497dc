"""The example engine's host work per decode step, by batch size (CPU; the tiny model runs but
is not timed).

A serving step's host side is three calls: the scheduler picks and reserves the rows
(``Scheduler.schedule``), the builder turns them into metadata and the backend's plan
(``MetadataBuilder.plan``), and the results are applied (``Scheduler.finish_step``: commit,
append the sampled tokens, free what finished). The overlapped loop hides them behind the
device's step as long as they are shorter; a small model's step, or a large batch, exposes
them. This times each call over the decode steps of a burst of requests (every request
admitted at once, prompts of 16 tokens, 40 new tokens each, a pool with room for all: no
preemption), medians over the steps after the first five, for 128 to 1,024 rows.

Prints a table and writes benchmarks/results/scheduler-<date>.json (``--out`` to move it).
Run: python benchmarks/bench_scheduler.py [--rows 128,256,512,1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by file path: common.py is beside this file
    sys.path.insert(0, str(HERE))

# common puts this checkout first on sys.path: the project is imported from source.
from common import batch_sizes, write_host_results  # noqa: E402

from examples.engine.loop import run_requests  # noqa: E402
from examples.engine.parts import engine_for  # noqa: E402
from examples.engine.scheduler import Request, Scheduler, make_preemption  # noqa: E402
from examples.model.llama import random_llama  # noqa: E402
from examples.model.shape import shape_for_cache  # noqa: E402
from kvcache import KVCacheConfig, MetadataBuilder, load_config  # noqa: E402

PROMPT, NEW_TOKENS, VOCAB = 16, 40, 256
#: The host calls timed: (class, method).
CALLS: tuple[tuple[type, str], ...] = (
    (Scheduler, "schedule"),
    (MetadataBuilder, "plan"),
    (Scheduler, "finish_step"),
)


@contextmanager
def timed_calls(times: dict[str, list[float]]) -> Iterator[None]:
    """Every call of :data:`CALLS` appends its seconds to ``times[method]`` (restored after)."""
    originals = [(cls, name, getattr(cls, name)) for cls, name in CALLS]

    def timer(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name].append(time.perf_counter() - start)

        return call

    try:
        for cls, name, fn in originals:
            setattr(cls, name, timer(name, fn))
        yield
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def measure(rows: int, seed: int = 0) -> dict[str, float]:
    """Median milliseconds of each host call per step, serving ``rows`` requests at once."""
    base = load_config("tiny-cpu")
    blocks = rows * 8
    config = KVCacheConfig.model_validate(
        {**base.model_dump(), "cache": {**base.cache.model_dump(), "num_blocks": blocks}}, strict=False
    )
    shape = shape_for_cache(config.model, vocab_size=VOCAB)
    engine = engine_for(config, shape, device=torch.device("cpu"), num_blocks=blocks)
    model = random_llama(shape, seed=seed, dtype=torch.float32, device=torch.device("cpu"))
    rng = random.Random(seed)

    def burst() -> list[Request]:
        return [Request(i, [rng.randrange(VOCAB) for _ in range(PROMPT)], NEW_TOKENS) for i in range(rows)]

    def serve(requests: list[Request]) -> None:
        run_requests(
            model,
            requests,
            manager=engine.manager,
            cache=engine.cache,
            backend=engine.backend,
            preemption=make_preemption("recompute", engine.manager, engine.cache, config.cache.swap_space),
            token_budget=rows * PROMPT,
            max_running=rows,
        )

    serve(burst())  # warm-up
    times: dict[str, list[float]] = {name: [] for _, name in CALLS}
    with timed_calls(times):
        serve(burst())
    return {name: statistics.median(v[5:-5] or v) * 1e3 for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="128,256,512,1024", help="comma-separated batch sizes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = batch_sizes(parser, args.rows)
    torch.set_num_threads(1)
    print(f"host work per decode step of the example engine (CPU, one thread; median ms over the steps of a "
          f"burst: prompts of {PROMPT}, {NEW_TOKENS} new tokens)")  # fmt: skip
    print(f"{'rows':>6} {'schedule':>9} {'plan':>7} {'finish':>7} {'total':>7} {'us/row':>7}")
    results = []
    for rows in sizes:
        ms = measure(rows)
        total = sum(ms.values())
        results.append({"rows": rows, **{f"{k}_ms": round(v, 4) for k, v in ms.items()}, "total_ms": round(total, 4)})
        print(f"{rows:>6} {ms['schedule']:>9.3f} {ms['plan']:>7.3f} {ms['finish_step']:>7.3f} {total:>7.3f} "
              f"{total / rows * 1e3:>7.2f}")  # fmt: skip
    out = write_host_results(args.out, "scheduler", f"python benchmarks/bench_scheduler.py --rows {args.rows}", results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
