"""What the GPU attention benchmarks share (bench_decode.py, bench_prefill.py; bench_e2e.py
uses the results folder and the version lookup). Not a benchmark: importing it only puts this
checkout first on ``sys.path``, so ``python3 benchmarks/bench_x.py`` runs the project from source.

- the shape every attention benchmark times: bf16, 32 query heads, 8 KV heads, head_dim 128
  (Llama-3-8B-like), and :func:`spec`, its ``AttentionSpec``;
- :class:`KernelTimer`: medians of ``triton.testing.do_bench`` (warm-up first, L2 flushed
  before every run), of calls from Python or of replays of one CUDA-graph capture;
- :func:`measure_copy_tbps`: device-to-device copy bandwidth, the yardstick of K/V read rates;
- :class:`Run`: one run's frame (copy bandwidth first, notes, the JSON with :func:`header`, the
  environment and definitions, written even when the run aborts, the exit status), with
  :func:`add_run_options` (``--out``, ``--warmup-ms``, ``--rep-ms``) and :func:`require_cuda`;
- CPU host benchmarks (bench_scheduler.py, bench_plan.py): :func:`batch_sizes`,
  :func:`write_host_results`;
- rows: :class:`JsonRow`, :func:`record_error`, :func:`rel_err`, :func:`set_vs_flash_attn`,
  :func:`flash_attn_backend`; tables: :func:`print_table`, :func:`fmt`, :func:`describe`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

#: The checkout this file is in; on ``sys.path`` first, so ``python3 benchmarks/bench_x.py``
#: imports the project from source (ahead of any installed copy).
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
#: A result further than this from its reference is flagged in the tables (and never "best").
REL_ERR_LIMIT = 2e-2
#: Bytes of the device-to-device copy that measures the copy bandwidth.
COPY_BYTES = 1 << 30
DEVICE = "cuda"


def spec(*, fp8: bool = False, window: int | None = None, int8: bool = False) -> Any:
    """The benchmarks' ``AttentionSpec`` (bf16 compute; an fp8, int8 or bf16 cache, an
    optional sliding window)."""
    from attention import AttentionSpec

    return AttentionSpec(
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        dtype="bfloat16",
        kv_cache_dtype="float8_e4m3" if fp8 else "int8" if int8 else None,
        sliding_window=window,
    )


def shuffled_block_tables(lens: Sequence[int], block_size: int, seed: int) -> tuple[torch.Tensor, int]:
    """(int32 [rows, max blocks] block tables on the host, the block count): every row's blocks,
    ``ceil(len / block_size)`` of them, at ids drawn from a seeded permutation (scattered as in a
    long-running cache); unused entries -1."""
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    tables = torch.full((len(per_row), max(per_row)), -1, dtype=torch.int32)
    offset = 0
    for r, nb in enumerate(per_row):
        tables[r, :nb] = perm[offset : offset + nb]
        offset += nb
    return tables, num_blocks


def add_run_options(parser: argparse.ArgumentParser, name: str) -> None:
    """The options every attention benchmark ends with: ``--out`` (default
    results/<name>-<date>.json), ``--warmup-ms`` and ``--rep-ms`` (do_bench's windows)."""
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default: results/{name}-<date>.json)")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)


def require_cuda(script: str) -> bool:
    """True with a GPU; otherwise says so on stderr (the caller exits 2)."""
    if torch.cuda.is_available():
        return True
    print(
        f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False); run it on the GPU "
        "machine. Nothing was measured.",
        file=sys.stderr,
    )
    return False


# ---- timing --------------------------------------------------------------------------------


class KernelTimer:
    """Median milliseconds of ``triton.testing.do_bench`` with ``warmup_ms`` / ``rep_ms``."""

    def __init__(self, warmup_ms: int, rep_ms: int) -> None:
        import triton.testing

        self._do_bench = triton.testing.do_bench
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def ms(self, fn: Callable[[], object]) -> float:
        """Median time of ``fn()`` called from Python (host launch costs included)."""
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
        try:
            return self.ms(graph.replay)
        finally:
            del graph


def measure_copy_tbps(timer: KernelTimer) -> float:
    """Device-to-device copy bandwidth in TB/s: bytes read + written / median time of copying
    :data:`COPY_BYTES` (printed as well)."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    t = timer.ms(lambda: dst.copy_(src))
    tbps = 2 * COPY_BYTES / (t * 1e-3) / 1e12
    print(f"device copy bandwidth: {tbps:.3f} TB/s (read+write, {COPY_BYTES >> 20} MiB)", flush=True)
    return tbps


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float32."""
    diff = (out.float() - ref.float()).abs().max()
    return float(diff / ref.float().abs().max())


def error_line(err: BaseException, limit: int = 300) -> str:
    """``Type: message``, its first line, at most ``limit`` characters (for a row's error)."""
    return f"{type(err).__name__}: {err}".splitlines()[0][:limit]


class FailedRow(Protocol):
    error: str | None


def record_error(row: FailedRow, err: Exception, label: str) -> None:
    """Keep going after a row's failure: its error goes on the row and is printed after
    ``label``. A CUDA error after which the context is gone is re-raised (nothing else can run)."""
    row.error = error_line(err)
    print(f"  ! {label}: {row.error}", flush=True)
    if "illegal memory access" in str(err) or "unspecified launch failure" in str(err):
        raise err


def flash_attn_backend(notes: list[str], rows: str, window: int | None = None) -> Any | None:
    """flash-attn 2 through ``attention.registry.get_backend``; None (and a note that the
    ``rows`` are skipped) when it is not installed."""
    from attention.registry import get_backend

    try:
        return get_backend("flash_attn", spec(window=window))
    except (ImportError, KeyError, ModuleNotFoundError) as err:
        notes.append(f"flash_attn {rows} skipped: {err}")
        return None


# ---- rows and tables -----------------------------------------------------------------------


class JsonRow:
    """A benchmark row (a dataclass with an ``extra`` dict): :meth:`as_json` drops unset fields
    and merges ``extra`` in."""

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra" and v is not None}
        out.update(self.__dict__["extra"])
        return out


class TimedRow(Protocol):
    backend: str
    ms: float | None
    vs_flash_attn: float | None


def set_vs_flash_attn(rows: Sequence[TimedRow]) -> None:
    """``vs_flash_attn`` = flash-attn's ms / each row's ms, over rows of one shape (> 1: faster
    than flash-attn); left unset where there is no flash-attn row."""
    fa_ms = next((r.ms for r in rows if r.backend == "flash_attn" and r.ms), None)
    for r in rows:
        if fa_ms and r.ms:
            r.vs_flash_attn = fa_ms / r.ms


class CheckedRow(Protocol):
    rel_err: float | None
    error: str | None


Checked = TypeVar("Checked", bound=CheckedRow)


def print_table(head: str, rows: Sequence[Checked], cells: Callable[[Checked], str]) -> None:
    """``head``, a rule under it, then each row's ``cells``, flagged ``CHECK`` when its rel_err
    is past :data:`REL_ERR_LIMIT` and followed by its error, if any."""
    print("\n" + head)
    print("-" * len(head))
    for r in rows:
        flag = "  CHECK" if r.rel_err is not None and r.rel_err > REL_ERR_LIMIT else ""
        print(f"{cells(r)}{flag}{'  ERROR ' + r.error if r.error else ''}")


def fmt(x: float | None, format_spec: str) -> str:
    """``format(x, format_spec)``, or a dash padded to the spec's width when there is no value."""
    width = int("".join(ch for ch in format_spec.split(".")[0] if ch.isdigit()) or 0)
    return "-".rjust(width) if x is None else format(x, format_spec)


def describe(config: Any) -> str:
    """Compact launch-parameter label of a kernel config: ``block_n=64 num_warps=4 num_stages=2``
    (a decode config's ``combine_num_warps`` left out)."""
    return " ".join(
        f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config) if f.name != "combine_num_warps"
    )


# ---- the JSON header -----------------------------------------------------------------------

#: Definitions both attention benchmarks' rows use.
DEFINITIONS = {
    "ms": "median of triton.testing.do_bench (L2 flushed before each run) over replays of one "
    "call captured in a CUDA graph: the GPU time, without host launch overhead",
    "eager_ms": "the same, calling the backend from Python each time (host overhead included)",
    "vs_flash_attn": "flash-attn ms / this row's ms (> 1: faster than flash-attn)",
}


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``; None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version(dist: str) -> str | None:
    """``dist``'s version, else the importable module's ``__version__`` (a build on the path
    without metadata), else None."""
    version = package_version(dist)
    if version is not None:
        return version
    try:
        module = __import__(dist.replace("-", "_"))
    except ImportError:
        return None
    return str(getattr(module, "__version__", "unknown"))


def batch_sizes(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """The CPU host benchmarks' ``--rows`` option (comma-separated batch sizes, each >= 1);
    anything else exits through ``parser.error`` naming the option."""
    try:
        sizes = [int(x) for x in text.split(",") if x]
    except ValueError:
        parser.error(f"--rows: {text!r}; give comma-separated integers, e.g. 128,512")
    if not sizes or min(sizes) < 1:
        parser.error(f"--rows: {text!r}; every batch size must be >= 1")
    return sizes


def write_host_results(out: Path | None, stem: str, command: str, rows: list[dict[str, Any]]) -> Path:
    """A CPU host benchmark's JSON (machine, Python and torch in the header) at ``out``, by
    default ``results/<stem>-<date>.json``; returns the path written."""
    import platform

    date = datetime.date.today().isoformat()
    path = out or RESULTS / f"{stem}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"header": {"date": date, "machine": platform.processor() or platform.machine(),
                      "python": platform.python_version(), "torch": torch.__version__, "command": command},
           "rows": rows}  # fmt: skip
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def header(copy_tbps: float, notes: list[str], definitions: dict[str, str]) -> dict[str, Any]:
    """The JSON header: device, versions, copy bandwidth, command, date, shape, the rows'
    ``definitions`` and the run's notes."""
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
        "definitions": definitions,
        "notes": notes,
    }


class Run:
    """The frame of one benchmark run: the copy bandwidth measured first, the notes, the JSON
    written even when the measuring aborts, and the exit status."""

    def __init__(self, name: str, out: Path | None, timer: KernelTimer, definitions: dict[str, str]) -> None:
        self.notes: list[str] = []
        self.copy_tbps = measure_copy_tbps(timer)
        self.started = time.monotonic()
        #: ``--out``, else benchmarks/results/<name>-<YYYY-MM-DD>.json.
        self.out = out or RESULTS / f"{name}-{datetime.date.today().isoformat()}.json"
        self._definitions = definitions

    def measure(self, body: Callable[[], None], document: Callable[[], dict[str, Any]]) -> None:
        """Run ``body``; an exception ends it with a note (``run aborted: ...``) and its
        traceback. Either way, write {"header": ..., **document()} to :attr:`out`, then print
        the notes."""
        try:
            body()
        except Exception:
            self.notes.append("run aborted: " + traceback.format_exc().splitlines()[-1])
            traceback.print_exc()
        finally:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            result = {"header": header(self.copy_tbps, self.notes, self._definitions), **document()}
            self.out.write_text(json.dumps(result, indent=1) + "\n")
        for note in self.notes:
            print("note: " + note)

    def finish(self) -> int:
        """Say where the JSON went (after the tables); the exit status: 1 if the run aborted."""
        print(f"wrote {self.out} ({time.monotonic() - self.started:.0f} s)")
        return 1 if any("aborted" in n for n in self.notes) else 0
