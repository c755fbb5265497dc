"""Where a serving step's host time goes: one workload of ``bench_e2e.py`` served once timed,
then once more under cProfile, and the functions with the most own and cumulative time printed.

For steps whose wall time the GPU does not cover (``bench_e2e``'s "no kernel running" and host
work per iteration): on an H100, a latent-attention model's eager mixed steps under the Poisson
workload took 36.6 ms of host work for 5.3 ms of GPU work (``bench_e2e.py
--no-latent-mixed-graphs``; captured, the default, 4.40 ms:
``benchmarks/results/e2e-mla-graphs-h100-2026-12-06.md``). Usage, from the project root::

    python3 benchmarks/host_profile.py [--requests N] [--top K] -- [bench_e2e arguments]

The bench_e2e arguments choose the model, the workload (the first of ``--workloads``; default
``--model deepseek-v2-lite --workloads poisson``) and the backend switches; its profile is off.
Prints the timed run's tokens/s and iteration medians, then two cProfile tables.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e

DEFAULT_BENCH_ARGS = ["--model", "deepseek-v2-lite", "--workloads", "poisson"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=96, help="the Poisson workload's requests (default 96)")
    p.add_argument("--top", type=int, default=30, help="functions printed per table (default 30)")
    p.add_argument("bench_args", nargs="*", help="bench_e2e arguments (after --)")
    args = p.parse_args(argv)
    given = args.bench_args or DEFAULT_BENCH_ARGS
    bench = bench_e2e._parser().parse_args(["--skip-transformers", "--no-profile", *given])
    s = dataclasses.replace(bench_e2e.settings_from(bench), poisson_requests=args.requests)
    model = bench_e2e.empty_llama(s.shape, dtype=bench_e2e.torch_dtype(s.dtype), device=s.device)
    bench_e2e.init_random_(model, seed=s.seed)
    workloads = bench_e2e.make_workloads(s)
    start = time.perf_counter()
    engine = bench_e2e.build_ours(model, workloads, s)
    print(f"build and warm-up: {time.perf_counter() - start:.1f} s", flush=True)
    name = s.workloads[0]
    workload = workloads[name]
    served = bench_e2e.serve(engine, workload, s)
    summary = bench_e2e.ours_summary(served, model, s, None)
    keys = ("tokens_per_s", "itl_median_ms", "decode_iter_median_ms", "decode_host_median_ms",
            "mixed_iter_median_ms", "mixed_host_median_ms", "mixed_rows_median")  # fmt: skip
    print(f"{name}: " + ", ".join(f"{k} {summary[k]:.2f}" for k in keys if isinstance(summary.get(k), float)))
    profiler = cProfile.Profile()
    profiler.enable()
    bench_e2e.serve(engine, workload, s)
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
