"""The decode step's matrix products: cuBLAS (``F.linear``) against our skinny GEMM
(:mod:`examples.model.skinny_gemm`) on the Llama-3-8B projections, weights read from HBM.

Each product is timed in a CUDA graph that cycles through enough copies of the weight (at
least 256 MiB) that none is in L2 when it is read, as in a 32-layer step. Prints a table
(time per product, fraction of the copy bandwidth it streams the weight at) and writes JSON.
``--sweep`` also times a grid of skinny configurations at the largest row count.

    python3 benchmarks/bench_gemm.py [--rows 32 64 128] [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # common.py is beside this file
    sys.path.insert(0, str(HERE))

# common puts this checkout first on sys.path: the project is imported from source.
from common import KernelTimer, Run, add_run_options, fmt, require_cuda  # noqa: E402

from examples.model.skinny_gemm import SkinnyConfig, default_skinny_config, skinny_linear  # noqa: E402

#: (name, N, K) of Llama-3-8B's products per layer, and the LM head.
SHAPES = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
]
MIN_BYTES = 256 << 20


def sweep_configs(k: int) -> list[SkinnyConfig]:
    """Tiles of 64 or 128 columns (4 warps; 8 too for 128), steps of 128, every split of K
    into 1-8 slices, 3 or 5 pipeline stages."""
    found = []
    for block_n, split, stages in itertools.product((64, 128), (1, 2, 4, 8), (3, 5)):
        if k % (split * 128):
            continue
        for warps in (4, 8) if block_n == 128 else (4,):
            found.append(SkinnyConfig(block_n, 128, split, warps, stages))
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--sweep", action="store_true", help="time a grid of configurations at the largest row count")
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    add_run_options(p, "gemm")
    args = p.parse_args()
    if not require_cuda("bench_gemm.py"):
        return 2
    timer = KernelTimer(args.warmup_ms, args.rep_ms)
    run = Run("gemm", args.out, timer, {
        "us": "median microseconds of one product (graph replay of a cycle over weight copies / copies)",
        "bw": "weight bytes / time, as a fraction of the device copy bandwidth",
    })  # fmt: skip
    rows_out: list[dict[str, Any]] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)

    def time_product(fn: Any, weights: list[torch.Tensor]) -> float:
        def cycle() -> None:
            for w in weights:
                fn(w)

        return 1e3 * timer.graph_ms(cycle) / len(weights)

    def body() -> None:
        for name, n, k in SHAPES:
            if name not in args.shapes:
                continue
            nbytes = n * k * 2
            copies = max(1, -(-MIN_BYTES // nbytes))
            weights = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)
            ]
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                ref = x.double() @ weights[0].double().T
                cublas_us = time_product(lambda w, x=x: F.linear(x, w), weights)
                row: dict[str, Any] = {"shape": name, "n": n, "k": k, "rows": m, "cublas_us": cublas_us}
                candidates = {"default": default_skinny_config(m, n, k, sms)}
                if args.sweep and m == max(args.rows):
                    candidates.update({str(c): c for c in sweep_configs(k)})
                best: tuple[float, str] | None = None
                for label, config in candidates.items():
                    if config is None:
                        continue
                    try:
                        out = skinny_linear(x, weights[0], config)
                        err = float((out.double() - ref).abs().max() / ref.abs().max())
                        if err > 2e-2:
                            raise RuntimeError(f"max error {err:.3g} relative to the largest output")
                        us = time_product(lambda w, c=config, x=x: skinny_linear(x, w, c), weights)
                    except Exception as e:  # a configuration that does not compile or run
                        run.notes.append(f"{name} rows {m} {label}: {type(e).__name__}: {str(e)[:160]}")
                        continue
                    if label == "default":
                        row["default_us"] = us
                        row["default_config"] = dataclasses.asdict(config)
                    if best is None or us < best[0]:
                        best = (us, label)
                if best is not None:
                    row["best_us"], row["best_config"] = best
                for key in ("cublas", "default", "best"):
                    if f"{key}_us" in row:
                        row[f"{key}_bw"] = nbytes / (row[f"{key}_us"] * 1e-6) / (run.copy_tbps * 1e12)
                rows_out.append(row)
                print(
                    f"{name:8s} rows {m:4d}: cuBLAS {fmt(row.get('cublas_us'), '.1f')} us "
                    f"({fmt(row.get('cublas_bw'), '.2f')}), skinny default {fmt(row.get('default_us'), '.1f')} us "
                    f"({fmt(row.get('default_bw'), '.2f')}), best {fmt(row.get('best_us'), '.1f')} us "
                    f"({fmt(row.get('best_bw'), '.2f')}) {row.get('best_config', '')}",
                    flush=True,
                )
            del weights
            torch.cuda.empty_cache()

    run.measure(body, lambda: {"rows": rows_out})
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
