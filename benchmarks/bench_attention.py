"""Paged attention on one GPU: our Triton kernels vs flash-attn 2 vs torch SDPA (unpaged).

Shape: bf16, 32 query heads, 8 KV heads, head_dim 128 (Llama-3-8B-like).

  decode:  see bench_decode.py: uniform and LogNormal-length batches, K/V read from HBM
           (a graph replays one call per layer over >= 400 MB of distinct caches); tbps = K/V
           bytes read / time, against the device-to-device copy bandwidth of the same run;
           triton at block 32 and 256 vs flash-attn 2 at block 256. ``--decode-sweep``
           also times the decode variants (combine modes, tiles, chunking policies).
  prefill: causal, every token new; tflops = 4 * batch * heads * head_dim * L^2 / 2 / time.

Prefill backends: ``triton`` at block 32 and 256, ``flash_attn`` at block 256 (through
``attention.registry.get_backend``; skipped with a note when flash-attn is missing), and
``sdpa``: torch's scaled_dot_product_attention on contiguous, unpaged K/V. Paged caches get
a random permutation of block ids, so no row's pages are contiguous. Before timing, every
(shape, backend) is checked against SDPA on the same data: ``rel_err`` = max |out - sdpa| /
max |sdpa|. Times are medians of ``triton.testing.do_bench`` (warm-up first, L2 flushed
before every run) of one layer call (the step's plan is made once, outside the timing), in two
ways: ``ms`` replays the call captured in a CUDA graph (the GPU's time, as serving engines run
decode), ``eager_ms`` calls the backend from Python (the backend's argument checks and kernel
launches included).

``--sweep`` also times the prefill kernel's candidates (``PREFILL_SWEEP``) and the decode
variants, and prints the best per shape, so one GPU run can pick the defaults.

Prints the tables last and writes benchmarks/results/attention-<YYYY-MM-DD>.json
({"header": {...}, "rows": [prefill rows], "decode": [...], "decode_best": [...],
"sweep": [prefill sweep rows]}).

Run (from the project root, on the GPU machine):
    python3 benchmarks/bench_attention.py [--quick] [--decode-only] [--decode-sweep]
        [--sweep | --sweep-only] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# The project's packages from this checkout (ahead of any installed copy), and bench_decode
# beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import (
    Timer,
    best_per_shape,
    decode_shapes,
    fp8_speedups,
    print_best,
    print_decode_table,
    print_fp8,
    run_decode,
    run_window,
)

RESULTS = Path(__file__).resolve().parent / "results"

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
PREFILL_SHAPES = [(8, 4096), (32, 1024), (2, 16384)]
QUICK_PREFILL = [(32, 1024)]
#: A result further than this from SDPA (bf16 vs bf16) is flagged in the table.
REL_ERR_LIMIT = 2e-2
COPY_BYTES = 1 << 30
DEVICE = "cuda"


@dataclass
class Row:
    op: str
    backend: str
    batch: int
    seq_len: int
    block_size: int | None
    ms: float | None = None
    eager_ms: float | None = None
    tbps: float | None = None
    tflops: float | None = None
    rel_err: float | None = None
    vs_flash_attn: float | None = None
    variant: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra" and v is not None}
        out.update(self.extra)
        return out


# ---- problems ----------------------------------------------------------------------------


@dataclass
class Problem:
    """Random Q/K/V for ``batch`` rows of ``seq_len`` tokens, ``query_len`` of them new.

    q: [batch * query_len, HEADS, HEAD_DIM]; k, v: [batch, seq_len, KV_HEADS, HEAD_DIM].
    """

    op: str
    batch: int
    seq_len: int
    query_len: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @staticmethod
    def make(op: str, batch: int, seq_len: int, seed: int = 0) -> Problem:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        query_len = 1 if op == "decode" else seq_len
        shape_kv = (batch, seq_len, KV_HEADS, HEAD_DIM)
        q = torch.randn((batch * query_len, HEADS, HEAD_DIM), generator=gen, device=DEVICE)
        k = torch.randn(shape_kv, generator=gen, device=DEVICE)
        v = torch.randn(shape_kv, generator=gen, device=DEVICE)
        return Problem(op, batch, seq_len, query_len, q.to(DTYPE), k.to(DTYPE), v.to(DTYPE))

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def causal_flops(self) -> float:
        return 4.0 * self.batch * HEADS * HEAD_DIM * self.seq_len * self.seq_len / 2

    def paged(self, block_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(k_cache, v_cache, metadata) with the rows' blocks at shuffled ids."""
        from attention import AttentionMetadata

        b, seq, q_len = self.batch, self.seq_len, self.query_len
        per_row = -(-seq // block_size)
        num_blocks = b * per_row
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=gen, device=DEVICE)
        tables = perm.view(b, per_row).to(torch.int32)
        pad = per_row * block_size - seq
        caches = []
        for src in (self.k, self.v):
            blocks = F.pad(src, (0, 0, 0, 0, 0, pad)).view(num_blocks, block_size, KV_HEADS, HEAD_DIM)
            cache = torch.empty_like(blocks)
            cache[perm] = blocks  # token block j of the batch lives at block id perm[j]
            caches.append(cache)
        pos = torch.arange(seq - q_len, seq, device=DEVICE)
        slots = tables[:, pos // block_size].long() * block_size + pos % block_size
        meta = AttentionMetadata(
            block_tables=tables,
            seq_lens=torch.full((b,), seq, dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=DEVICE) * q_len,
            slot_mapping=slots.flatten(),
            positions=pos.repeat(b),
            logits_indices=(torch.arange(b, device=DEVICE) + 1) * q_len - 1,
            block_size=block_size,
            seq_lens_host=(seq,) * b,
            query_lens_host=(q_len,) * b,
            sampling_rows_host=tuple(range(b)),
        )
        return caches[0], caches[1], meta


def _sdpa_fn(p: Problem) -> Callable[[], torch.Tensor]:
    """SDPA on contiguous [batch, heads, len, dim] K/V; returns [tokens, HEADS, HEAD_DIM].

    Decode passes the KV heads as they are (``enable_gqa``), so K/V bytes read stay what the
    tbps column counts. Prefill, which is compute-bound, gets K/V repeated to every query
    head so that SDPA's fused kernels (not its O(L^2)-memory math path) always apply.
    """
    q = p.q.view(p.batch, p.query_len, HEADS, HEAD_DIM).transpose(1, 2)
    k = p.k.transpose(1, 2).contiguous()
    v = p.v.transpose(1, 2).contiguous()
    causal = p.query_len > 1  # prefill: all tokens new, so top-left == bottom-right alignment
    if causal:
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)

    def run() -> torch.Tensor:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=not causal)
        return o.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)

    return run


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).abs().max()
    return float(diff / ref.float().abs().max())


# ---- measuring ---------------------------------------------------------------------------


class Bench:
    def __init__(self, warmup_ms: int, rep_ms: int):
        import triton.testing

        self._do_bench = triton.testing.do_bench
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def ms(self, fn: Callable[[], object]) -> float:
        fn()  # compile / first-call costs stay out of the warm-up estimate
        torch.cuda.synchronize()
        return float(self._do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))

    def graph_ms(self, fn: Callable[[], object]) -> float:
        """Median time of ``fn`` captured once in a CUDA graph and replayed: the GPU work of
        one call without the host's launch cost, as a serving engine runs decode steps."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up outside the capture (compiles, fills per-step caches)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.ms(graph.replay)

    def copy_tbps(self) -> float:
        src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
        dst = torch.empty_like(src)
        t = self.ms(lambda: dst.copy_(src))
        return 2 * COPY_BYTES / (t * 1e-3) / 1e12


def _measure(bench: Bench, row: Row, p: Problem, fn: Callable[[], torch.Tensor], ref: torch.Tensor | None) -> Row:
    """Check ``fn`` against ``ref``, then time it; errors are recorded, not raised."""
    try:
        out = fn()
        torch.cuda.synchronize()
        if ref is not None:
            row.rel_err = _rel_err(out, ref)
        del out
        row.eager_ms = bench.ms(fn)
        try:
            row.ms = bench.graph_ms(fn)
        except Exception as err:  # a backend that cannot be captured is timed eagerly
            row.ms = row.eager_ms
            row.extra["graph_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
        if p.op == "decode":
            row.tbps = p.kv_bytes / (row.ms * 1e-3) / 1e12
        else:
            row.tflops = p.causal_flops / (row.ms * 1e-3) / 1e12
    except Exception as err:  # keep going: one failing variant must not end a one-shot run
        row.error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        print(
            f"  ! {row.op} {row.backend} b={row.batch} L={row.seq_len} bs={row.block_size} "
            f"{row.variant or ''}: {row.error}",
            flush=True,
        )
        if "illegal memory access" in str(err) or "unspecified launch failure" in str(err):
            raise  # the CUDA context is gone; nothing after this can run
    return row


def _attend_fn(backend: Any, p: Problem, caches: tuple[torch.Tensor, torch.Tensor, Any]) -> Callable[[], torch.Tensor]:
    from attention import LayerCache

    k_cache, v_cache, meta = caches
    layer = LayerCache(k_cache, v_cache)
    plan = backend.plan(meta)  # once per step, outside the timing
    out = torch.empty_like(p.q)

    def run() -> torch.Tensor:
        return backend.attend(p.q, layer, plan, out=out)

    return run


def _spec() -> Any:
    from attention import AttentionSpec

    return AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, dtype="bfloat16")


def _flash_attn_backend(notes: list[str]) -> Any | None:
    from attention.registry import get_backend

    try:
        return get_backend("flash_attn", _spec())
    except (ImportError, KeyError, ModuleNotFoundError) as err:
        notes.append(f"flash_attn rows skipped: {err}")
        return None


def run_main(bench: Bench, prefill: list[tuple[int, int]], notes: list[str]) -> list[Row]:
    """Prefill rows (decode: bench_decode.run_decode)."""
    from attention.triton_backend import TritonBackend

    flash = _flash_attn_backend(notes)
    rows: list[Row] = []
    for op, shapes in (("prefill", prefill),):
        for batch, seq_len in shapes:
            p = Problem.make(op, batch, seq_len)
            sdpa = _sdpa_fn(p)
            ref = sdpa()
            print(f"{op} batch={batch} seq_len={seq_len}", flush=True)
            shape_rows = [_measure(bench, Row(op, "sdpa", batch, seq_len, None), p, sdpa, ref)]
            for block_size in (32, 256):
                caches = p.paged(block_size)
                triton_backend = TritonBackend(_spec())
                row = Row(op, "triton", batch, seq_len, block_size)
                fn = _attend_fn(triton_backend, p, caches)
                shape_rows.append(_measure(bench, row, p, fn, ref))
                if block_size == 256 and flash is not None:
                    fa = Row(op, "flash_attn", batch, seq_len, block_size)
                    shape_rows.append(_measure(bench, fa, p, _attend_fn(flash, p, caches), ref))
                del caches, fn
            fa_ms = next((r.ms for r in shape_rows if r.backend == "flash_attn" and r.ms), None)
            for r in shape_rows:
                if fa_ms and r.ms:
                    r.vs_flash_attn = fa_ms / r.ms
            rows += shape_rows
            del p, ref, sdpa
            torch.cuda.empty_cache()
    return rows


def run_sweep(bench: Bench, prefill: list[tuple[int, int]]) -> list[Row]:
    """Time the prefill kernel's launch candidates; prints the best per (shape, block size).
    (The decode sweep is bench_decode.run_decode with sweep=True.)"""
    from attention.triton_backend import TritonBackend
    from attention.triton_kernels import PREFILL_SWEEP, default_prefill_config

    rows: list[Row] = []
    best_lines: list[str] = []
    for op, shapes in (("prefill", prefill),):
        for batch, seq_len in shapes:
            p = Problem.make(op, batch, seq_len)
            ref = _sdpa_fn(p)()
            for block_size in (32, 256):
                caches = p.paged(block_size)
                default_p = default_prefill_config(HEAD_DIM, DTYPE)
                variants: list[tuple[str, Any]] = [(f"default {_describe(default_p)}", TritonBackend(_spec()))]
                variants += [(_describe(c), TritonBackend(_spec(), prefill_config=c)) for c in PREFILL_SWEEP]
                found: list[Row] = []
                for name, backend in variants:
                    row = Row(op, "triton", batch, seq_len, block_size, variant=name)
                    found.append(_measure(bench, row, p, _attend_fn(backend, p, caches), ref))
                timed = [r for r in found if r.ms is not None and (r.rel_err or 0) < REL_ERR_LIMIT]
                if timed:
                    best = min(timed, key=lambda r: r.ms or 0.0)
                    base = found[0].ms
                    gain = f" ({base / best.ms:.2f}x vs default)" if base and best.ms else ""
                    best_lines.append(
                        f"{op:7s} b={batch:<4d} L={seq_len:<6d} bs={block_size:<4d} best "
                        f"{best.ms:.4f} ms{gain}: {best.variant}"
                    )
                for r in found:
                    print(
                        f"  sweep {op} b={batch} L={seq_len} bs={block_size} "
                        f"{_fmt(r.ms, '.4f')} ms  rel_err={_fmt(r.rel_err, '.1e')}  {r.variant}",
                        flush=True,
                    )
                rows += found
                del caches
            del p, ref
            torch.cuda.empty_cache()
    print("\nsweep: best per shape")
    for line in best_lines:
        print("  " + line)
    return rows


# ---- reporting ---------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or a dash padded to the spec's width when there is no value."""
    width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0)
    return "-".rjust(width) if x is None else format(x, spec)


def _describe(config: Any) -> str:
    """Compact launch-parameter label: ``block_n=64 num_warps=4 num_stages=3``."""
    return " ".join(f"{k}={v}" for k, v in config.__dict__.items() if k != "reduce_num_warps")


def print_table(rows: list[Row], copy_tbps: float) -> None:
    head = (
        f"{'op':7s} {'backend':10s} {'batch':>5s} {'seq_len':>7s} {'block':>5s} {'ms':>9s} {'eager':>8s} "
        f"{'TB/s':>6s} {'%copy':>6s} {'TFLOP/s':>8s} {'vs_fa':>6s} {'rel_err':>8s}"
    )
    print("\n" + head)
    print("-" * len(head))
    for r in rows:
        pct = None if r.tbps is None else 100 * r.tbps / copy_tbps
        flag = "  CHECK" if r.rel_err is not None and r.rel_err > REL_ERR_LIMIT else ""
        print(
            f"{r.op:7s} {r.backend:10s} {r.batch:5d} {r.seq_len:7d} "
            f"{'-' if r.block_size is None else r.block_size:>5} {_fmt(r.ms, '9.4f')} {_fmt(r.eager_ms, '8.4f')} "
            f"{_fmt(r.tbps, '6.2f')} {_fmt(pct, '6.1f')} {_fmt(r.tflops, '8.1f')} "
            f"{_fmt(r.vs_flash_attn, '6.2f')} {_fmt(r.rel_err, '8.1e')}"
            f"{flag}{'  ERROR ' + r.error if r.error else ''}"
        )
    print(
        f"(ms: CUDA-graph replay, the GPU time of one call; eager: the same call from Python, host "
        f"overhead included; device copy bandwidth {copy_tbps:.2f} TB/s read+write; vs_fa = "
        f"flash-attn ms / this ms, > 1 is faster than flash-attn)"
    )


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        try:
            module = __import__(dist.replace("-", "_"))
            return str(getattr(module, "__version__", "unknown"))
        except ImportError:
            return None


def header(copy_tbps: float, notes: list[str]) -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "flash_attn": _version("flash-attn"),
        "copy_tbps": round(copy_tbps, 4),
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "shape": {"dtype": "bfloat16", "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "definitions": {
            "ms": "median of triton.testing.do_bench (L2 flushed before each run) over replays of one "
            "call captured in a CUDA graph: the GPU time, without host launch overhead",
            "eager_ms": "the same, calling the backend from Python each time (host overhead included)",
            "tbps": "decode: K/V bytes read (2 x tokens x kv_heads x head_dim x 2) / time",
            "decode_ms": "decode rows: one CUDA graph replaying one call per layer over `layers` distinct "
            "caches (>= 400 MB of K/V, so every call reads HBM), divided by `layers`; eager_ms likewise",
            "decode_rel_err": "decode rows: max |out - ref| / max |ref| against a float32 reference from "
            "the cache",
            "chunk_len/items/partials": "decode rows: the triton schedule (tokens per chunk, work items, "
            "partial slots)",
            "tflops": "prefill: 4 x batch x heads x head_dim x seq_len^2 / 2 / time (causal)",
            "rel_err": "max |out - sdpa| / max |sdpa| on the same data",
            "vs_flash_attn": "flash-attn ms / this row's ms (> 1: faster than flash-attn)",
        },
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short subset of the shapes")
    parser.add_argument("--decode-only", action="store_true", help="skip prefill")
    parser.add_argument("--decode-sweep", action="store_true", help="also time the decode variants")
    parser.add_argument("--decode-budget-s", type=float, default=270.0, help="stop decode sweep variants after this")
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel parameters (prefill and decode)")
    parser.add_argument("--sweep-only", action="store_true", help="the sweeps, without the prefill main rows")
    parser.add_argument("--window", action="store_true", help="also time sliding-window decode past the window")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_attention: needs a CUDA GPU (torch.cuda.is_available() is False); run it "
            "on the GPU machine. Nothing was measured.",
            file=sys.stderr,
        )
        return 2
    prefill = QUICK_PREFILL if args.quick else PREFILL_SHAPES
    bench = Bench(args.warmup_ms, args.rep_ms)
    notes: list[str] = []
    copy_tbps = bench.copy_tbps()
    print(f"device copy bandwidth: {copy_tbps:.3f} TB/s (read+write, {COPY_BYTES >> 20} MiB)", flush=True)
    rows: list[Row] = []
    sweep: list[Row] = []
    decode: list[Any] = []
    window: list[Any] = []
    started = time.monotonic()
    out = args.out or RESULTS / f"attention-{datetime.date.today().isoformat()}.json"
    try:
        # Decode replays >= 400 MB per timing, so shorter timing windows keep the sweep short.
        timer = Timer(min(args.warmup_ms, 10), min(args.rep_ms, 50))
        decode_sweep = args.decode_sweep or args.sweep or args.sweep_only
        decode = run_decode(
            decode_shapes(args.quick),
            sweep=decode_sweep,
            timer=timer,
            copy_tbps=copy_tbps,
            notes=notes,
            budget_s=args.decode_budget_s,
        )
        notes.append(f"decode part took {time.monotonic() - started:.0f} s")
        if args.window:
            window = run_window(timer, copy_tbps, notes)
        if not (args.sweep_only or args.decode_only):
            rows = run_main(bench, prefill, notes)
        if (args.sweep or args.sweep_only) and not args.decode_only:
            sweep_bench = Bench(min(args.warmup_ms, 10), min(args.rep_ms, 40))
            sweep = run_sweep(sweep_bench, prefill)
    except Exception:
        notes.append("run aborted: " + traceback.format_exc().splitlines()[-1])
        traceback.print_exc()
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {"header": header(copy_tbps, notes), "rows": [r.as_json() for r in rows]}
        if decode:
            result["decode"] = [r.as_json() for r in decode]
            result["decode_best"] = best_per_shape(decode)
            result["decode_fp8"] = fp8_speedups(decode)
        if window:
            result["decode_window"] = [r.as_json() for r in window]
        if sweep:
            result["sweep"] = [r.as_json() for r in sweep]
        out.write_text(json.dumps(result, indent=1) + "\n")
    for note in notes:
        print("note: " + note)
    if rows:
        print_table(rows, copy_tbps)
    if window:
        print_decode_table(window)
    if decode:
        print_decode_table(decode)
        print_fp8(fp8_speedups(decode))
        print_best(best_per_shape(decode), copy_tbps)
    print(f"wrote {out} ({time.monotonic() - started:.0f} s)")
    return 1 if any("aborted" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
