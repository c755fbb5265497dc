"""The end-to-end attention time over an 8-bit KV cache against the bf16 cache, same machine,
runs alternating: issue 20's "in the end-to-end step, attention time with fp8 <= 0.6x bf16".

Runs ``benchmarks/bench_e2e.py --skip-transformers --workloads burst`` (Llama-3-8B shapes,
random weights, 128 requests at once, CUDA graphs) over the bf16 cache, then over the 8-bit
cache (``--cache``, default float8_e4m3), ``--pairs`` times in that order, each run its own
process. From each run's profile (a window of pure-decode iterations re-run under
torch.profiler) it reads the attention kernels' ms per iteration (the decode kernel and the
combine), and prints a table, the ratio of the two caches' median attention times against
the target, and writes the runs and the ratio as JSON.

    python3 benchmarks/e2e_cache_ratio.py [--cache int8] [--pairs 3] [--block-size 32] [--out x.json]
        [-- more bench_e2e.py arguments, given to every run: --hopper-decode never, ...]

The profile exists on CUDA only: elsewhere (``-- --tiny --device cpu``, the same code path in
seconds) the runs happen and the ratio reads n/a. A run that fails stops the script with its
command and the end of its output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from common import RESULTS, ROOT, fmt

BENCH_E2E = ROOT / "benchmarks" / "bench_e2e.py"
#: Issue 20: attention time over an fp8 cache at most this share of the bf16 cache's.
TARGET_RATIO = 0.6
#: The 16-bit cache every run pairs against (the model's dtype: no --kv-cache-dtype).
BASELINE = "bf16"
CACHES = ("float8_e4m3", "int8")
#: bench_e2e arguments this script sets per run, refused after ``--``.
OWN_ARGUMENTS = ("--kv-cache-dtype", "--out", "--workloads", "--skip-transformers")
#: bench_e2e's output lines worth keeping on the console (the rest stays in each run's JSON).
ECHOED = ("kernels compiled while serving", "slowest iterations", "profile: per iteration")


@dataclass
class CacheRun:
    """One bench_e2e run's figures (None where the run had no profile: not on CUDA)."""

    cache: str
    index: int
    attention_ms: float | None
    decode_ms: float | None
    combine_ms: float | None
    tokens_per_s: float | None
    itl_p99_ms: float | None
    compiles_while_serving: int | None
    json_path: str


def bench_command(cache: str, out: Path, block_size: int | None, extra: Sequence[str]) -> list[str]:
    """The bench_e2e command line of one run: the burst, our engine only, ``cache`` (``bf16``:
    the model dtype's cache), its JSON at ``out``, then ``extra`` as given."""
    if cache != BASELINE and cache not in CACHES:
        raise ValueError(f"cache {cache!r} is not one of {(BASELINE, *CACHES)}")
    command = [sys.executable, str(BENCH_E2E), "--skip-transformers", "--workloads", "burst", "--out", str(out)]
    if cache != BASELINE:
        command += ["--kv-cache-dtype", cache]
    if block_size is not None:
        command += ["--block-size", str(block_size)]
    return command + list(extra)


def read_run(cache: str, index: int, path: Path) -> CacheRun:
    """A run's figures from its bench_e2e JSON (the burst workload)."""
    doc = json.loads(path.read_text())
    burst = doc["results"]["workloads"]["burst"]
    ours = burst.get("ours") or {}
    profile = burst.get("profile") or {}
    parts = profile.get("attention_ms_per_iteration") or {}
    attention = (profile.get("ms_per_iteration") or {}).get("attention")
    watch = ours.get("compiles_while_serving") or {}
    return CacheRun(
        cache=cache,
        index=index,
        attention_ms=attention,
        decode_ms=parts.get("decode", attention) if profile else None,
        combine_ms=parts.get("combine", 0.0) if profile else None,
        tokens_per_s=ours.get("tokens_per_s"),
        itl_p99_ms=ours.get("itl_p99_ms"),
        compiles_while_serving=watch.get("count") if watch.get("available") else None,
        json_path=str(path),
    )


def ratio_of(runs: Sequence[CacheRun], cache: str) -> float | None:
    """Median attention ms of ``cache``'s runs over the bf16 runs' median; None when either
    side has no profiled run."""

    def med(name: str) -> float | None:
        values = [r.attention_ms for r in runs if r.cache == name and r.attention_ms is not None]
        return statistics.median(values) if values else None

    mine, base = med(cache), med(BASELINE)
    return None if mine is None or base is None or base <= 0 else mine / base


def target_line(ratio: float | None, cache: str) -> str:
    """bench_e2e's target format: PASS / FAIL / n/a, the figure, the target."""
    verdict = "n/a" if ratio is None else "PASS" if ratio <= TARGET_RATIO else "FAIL"
    figure = "-" if ratio is None else f"{ratio:.3f}x"
    why = " (no profile: CUDA only)" if ratio is None else ""
    return (
        f"target e2e_attention_{cache}_vs_bf16: {verdict} (burst decode attention ms, median over runs, "
        f"{cache} / bf16 = {figure}{why}; target <= {TARGET_RATIO}x)"
    )


def table(runs: Sequence[CacheRun]) -> str:
    """One line a run: its attention ms (decode + combine), tokens/s, ITL p99, compiles while serving."""
    head = (
        f"{'cache':<12} {'run':>3} {'attention ms':>12} {'decode':>8} {'combine':>8} {'tokens/s':>9} "
        f"{'ITL p99':>8} compiles"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r.cache:<12} {r.index:>3} {fmt(r.attention_ms, '.3f'):>12} {fmt(r.decode_ms, '.3f'):>8} "
            f"{fmt(r.combine_ms, '.3f'):>8} {fmt(r.tokens_per_s, ',.0f'):>9} {fmt(r.itl_p99_ms, '.1f'):>8} "
            f"{'-' if r.compiles_while_serving is None else r.compiles_while_serving}"
        )
    return "\n".join(lines)


def run_bench(command: list[str]) -> str:
    """Runs one bench_e2e process; its output, or a RuntimeError naming the command and the
    end of the output when it fails."""
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *inherited])}  # this checkout first
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT, env=env)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {' '.join(command)}\n{output[-3000:]}")
    return output


def measure(
    cache: str,
    pairs: int,
    block_size: int | None,
    extra: Sequence[str],
    runs_dir: Path,
    runner: Callable[[list[str]], str] = run_bench,
) -> list[CacheRun]:
    """``pairs`` x (bf16 run, ``cache`` run), in that order; each run's JSON in ``runs_dir``."""
    runs: list[CacheRun] = []
    for index in range(1, pairs + 1):
        for name in (BASELINE, cache):
            path = runs_dir / f"e2e-{name}-{index}.json"
            command = bench_command(name, path, block_size, extra)
            print(f"[{name} {index}] {' '.join(command[1:])}", flush=True)
            output = runner(command)
            for line in output.splitlines():
                if any(word in line for word in ECHOED):
                    print("   " + line.strip(), flush=True)
            runs.append(read_run(name, index, path))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    given = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cache", choices=CACHES, default="float8_e4m3", help="the 8-bit cache (default float8_e4m3)")
    p.add_argument("--pairs", type=int, default=2, help="bf16 / 8-bit run pairs (default 2)")
    p.add_argument("--block-size", type=int, help="bench_e2e's --block-size for every run (default: its own)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/e2e-cache-ratio-<cache>-<date>.json)")
    p.add_argument("--runs-dir", help="where each run's bench_e2e JSON goes (default: a temporary folder)")
    args = p.parse_args(argv)
    for own in OWN_ARGUMENTS:
        if any(a == own or a.startswith(own + "=") for a in extra):
            p.error(f"{own} after '--': this script sets it for each run (the cache: --cache; the JSON: --out)")
    if args.pairs < 1:
        p.error(f"--pairs {args.pairs}: give at least 1 (one bf16 and one {args.cache} run)")
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else RESULTS / f"e2e-cache-ratio-{args.cache}-{date}.json"
    with tempfile.TemporaryDirectory() as scratch:
        runs_dir = Path(args.runs_dir) if args.runs_dir else Path(scratch)
        runs_dir.mkdir(parents=True, exist_ok=True)
        try:
            runs = measure(args.cache, args.pairs, args.block_size, extra, runs_dir)
        except RuntimeError as err:
            print(f"a bench_e2e run failed: {err}", file=sys.stderr)
            return 1
        runs_json = [json.loads(Path(r.json_path).read_text()) for r in runs]
    ratio = ratio_of(runs, args.cache)
    print()
    print(table(runs))
    print(target_line(ratio, args.cache))
    doc = {
        "header": {
            "date": date,
            "command": " ".join(["python3", "benchmarks/e2e_cache_ratio.py", *given]),
            "definitions": {
                "attention ms": "attention kernels' GPU ms per pure-decode iteration in bench_e2e's profile window "
                "(decode kernel + combine), the burst workload",
                "ratio": f"median attention ms over the {args.cache} runs / median over the bf16 runs",
            },
        },
        "cache": args.cache,
        "extra_bench_e2e_arguments": extra,
        "runs": [asdict(r) for r in runs],
        "ratio": ratio,
        "target": {"max_ratio": TARGET_RATIO, "met": None if ratio is None else ratio <= TARGET_RATIO},
        "bench_e2e_results": runs_json,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
