"""Where a decode call's GPU time goes: torch.profiler over bench_decode.py's problems, kernel
time per layer call by kernel (the chunk kernel, the combine, anything else), per cache.

For each shape (``bench_decode.py``'s labels), block size and cache (bf16, fp8, int8), it
builds the same layers as bench_decode.py (K/V read from HBM: enough layers that L2 holds
none), checks layer 0 against the float32 reference, runs every layer ``--rounds`` times
eagerly under torch.profiler (CUDA activity only) and divides each kernel's total by the
calls. The chunk kernel's time against the whole call's says what the combine and the
launches cost; its bytes per second says how near HBM it runs.

Prints a table last and writes benchmarks/results/profile-decode-<YYYY-MM-DD>.json. Without a
CUDA GPU it says so and exits 2.

Run (from the project root, on the GPU machine):
    python3 benchmarks/profile_decode.py [--shapes lognormal64(med=512,64x4096] [--blocks 32,256]
        [--caches bf16,fp8,int8] [--rounds 20] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by file path (the tests): common.py is beside this file
    sys.path.insert(0, str(HERE))

import bench_decode  # noqa: E402
import common  # noqa: E402
import torch  # noqa: E402

CACHES = {"bf16": bench_decode.Variant("default"), "fp8": bench_decode.FP8_VARIANT, "int8": bench_decode.INT8_VARIANT}


def kernel_times(layers: Any, variant: Any, block_size: int, rounds: int) -> dict[str, Any]:
    """GPU microseconds per layer call, by kernel name, over ``rounds`` x every layer; and the
    check of layer 0 against the reference."""
    from torch.profiler import ProfilerActivity, profile

    backend = variant.backend(block_size)
    plan = backend.plan(layers.meta)
    caches = layers.layer_caches(variant.fp8, False, variant.int8)
    out = torch.empty_like(layers.q)
    ref = bench_decode.reference(layers, fp8=variant.fp8, int8=variant.int8)
    err = common.rel_err(backend.attend(layers.q, caches[0], plan, out=out), ref)
    for i in range(layers.count):  # warm (compiles) outside the profile
        backend.attend(layers.q, caches[i], plan, out=out)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            for i in range(layers.count):
                backend.attend(layers.q, caches[i], plan, out=out)
        torch.cuda.synchronize()
    calls = rounds * layers.count
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / calls  # microseconds
    schedule = plan.decode[0].schedule if getattr(plan, "decode", None) else None
    return {
        "rel_err": err,
        "items": None if schedule is None else schedule.num_items,
        "kernels_us": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])),
        "total_us": sum(per_kernel.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="lognormal64(med=512,64x4096", help="bench_decode.py labels")
    parser.add_argument("--blocks", default="32,256")
    parser.add_argument("--caches", default="bf16,fp8,int8", help=f"of {','.join(CACHES)}")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    unknown = [c for c in caches if c not in CACHES]
    if unknown:
        parser.error(f"--caches: {unknown} not among {list(CACHES)}")
    if args.rounds < 1:
        parser.error(f"--rounds: {args.rounds} must be >= 1")
    if not common.require_cuda("profile_decode"):
        return 2
    rows = []
    for shape in bench_decode.decode_shapes(False, args.shapes):
        for block_size in (int(b) for b in args.blocks.split(",")):
            layers = bench_decode.build_layers(shape, block_size)
            for name in caches:
                got = kernel_times(layers, CACHES[name], block_size, args.rounds)
                rows.append({"shape": shape.label, "block_size": block_size, "cache": name, **got})
                total = got["total_us"]
                print(f"{shape.label[:28]:28s} {block_size:4d} {name:5s} {total:8.1f} us  items={got['items']}")
                for kernel, us in got["kernels_us"].items():
                    print(f"      {us:8.2f} us  {kernel[:90]}")
            del layers
            torch.cuda.empty_cache()
    date = datetime.date.today().isoformat()
    path = args.out or common.RESULTS / f"profile-decode-{date}.json"
    header = {"date": date, "command": " ".join(["python3", *sys.argv]), "device": torch.cuda.get_device_name()}
    path.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
