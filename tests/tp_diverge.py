"""Run by ``tests/test_tensor_parallel.py`` under torchrun: two gloo ranks serve the tiny
workload, and at step ``DIVERGE_AT`` rank 1 alone lets one running request generate more
tokens (an input only it sees). Each rank writes what happened to ``OUT_DIR/rank{r}.json``:
the error it raised (type, step, message) or that it finished.

    torchrun --standalone --nproc-per-node 2 tests/tp_diverge.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from attention.errors import RankDivergenceError
from examples.decode_loop import DEFAULT_CONFIG, VOCAB_SIZE
from examples.engine import engine_for
from examples.engine.distributed import exit_process, start_parallel, stop_parallel
from examples.engine.loop import run_requests
from examples.engine.scheduler import Scheduler, make_preemption
from examples.engine.workload import make_workload
from examples.model import random_llama, shape_for_cache
from kvcache import load_config

DIVERGE_AT = 6


def main(out_dir: str) -> int:
    config = load_config(DEFAULT_CONFIG)
    run = start_parallel(2, torch.device("cpu"), timeout_s=60)
    tp = run.tp
    reached_the_end = False  # every rank stops at the same step, so all of them get here
    try:
        shape = shape_for_cache(config.model, vocab_size=VOCAB_SIZE)
        engine = engine_for(config, shape, device="cpu", tp=tp, collective=run.collective)
        model = random_llama(shape, seed=0, tp=tp)
        model.connect(run.collective)
        requests = make_workload("default", 6, seed=0, block_size=config.cache.block_size, vocab_size=VOCAB_SIZE)

        def diverge(step: int, scheduler: Scheduler, elapsed: float, generated: int) -> None:
            if step == DIVERGE_AT and tp.rank == 1 and scheduler.running:
                scheduler.running[0].max_new_tokens += 5

        outcome: dict[str, object] = {"rank": tp.rank, "diverge_at": DIVERGE_AT}
        try:
            run_requests(
                model,
                requests,
                manager=engine.manager,
                cache=engine.cache,
                backend=engine.backend,
                preemption=make_preemption("recompute", engine.manager, engine.cache),
                on_step=diverge,
                collective=run.collective,
            )
            outcome["finished"] = True
        except RankDivergenceError as err:
            outcome.update(error=type(err).__name__, step=err.step, message=str(err))
        Path(out_dir, f"rank{tp.rank}.json").write_text(json.dumps(outcome))
        reached_the_end = True
    finally:
        # The barrier of a normal end: without it, rank 0 (the store's host) aborted at exit
        # once on the GPU machine under load ("terminate called without an active exception").
        stop_parallel(run, synchronize=reached_the_end)
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
