"""Which Triton / Gluon kernels compile while a block of code runs.

A serving engine compiles its kernel variants during warm-up; one that compiles later stalls
the step that first needs it for hundreds of milliseconds (a Triton compile), which shows up
as a p99 inter-token latency many times the median. :class:`CompileWatch` records every JIT
compile (a miss of the in-process kernel cache, whether the binary then comes from Triton's
disk cache or the compiler) through ``triton.knobs.runtime.jit_post_compile_hook``, so a
benchmark can say, after the warm-up, which kernels were still compiled while serving and with
which arguments' specialization (an integer argument equal to 1 or a multiple of 16, a pointer
aligned to 16 bytes: each a compile of its own unless the kernel says ``do_not_specialize``).

Without Triton, or a Triton without that hook, the watch records nothing and says so
(:attr:`CompileWatch.available`). :func:`examples.engine.loop.run_requests` watches its
serving loop (``RunReport.compiles_after_warmup``), as ``benchmarks/bench_e2e.py`` does.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

__all__ = ["CompileWatch", "KernelCompile", "describe_compiles"]


@dataclass(frozen=True)
class KernelCompile:
    """One JIT compile: the kernel's name, its launch signature as Triton prints it (argument
    types and specialization, num_warps, num_stages), when it finished (``time.perf_counter``)
    and the specialization Triton compiled it for: the attributes per argument index (e.g.
    ``tt.divisibility`` 16 for an aligned pointer or a multiple of 16) and the kernel cache's
    key ("key=..."), "" when Triton gives neither: two compiles of one kernel differ there."""

    name: str
    signature: str
    at: float
    attrs: str = ""


def describe_compiles(names: list[str], *, after_warmup: bool = False) -> str:
    """``names`` (one per compile) for a log line: "none", or the count and each kernel with
    its compiles, e.g. "3 (_decode_hopper_kernel x2, _combine x1)"; ``after_warmup``: compiles
    a warm-up should have made, so a non-empty list ends "; the warm-up missed them"."""
    if not names:
        return "none"
    listed = ", ".join(f"{name} x{n}" for name, n in Counter(names).items())
    missed = "; the warm-up missed them" if after_warmup else ""
    return f"{len(names)} ({listed}){missed}"


def _runtime_knobs() -> Any | None:
    """``triton.knobs.runtime`` where it has the post-compile hook, else None."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_post_compile_hook") else None


@dataclass
class CompileWatch:
    """A context manager recording every Triton JIT compile inside it into :attr:`compiles`;
    the hook that was installed before (if any) still runs, and is put back on exit. Not
    reentrant: one watch at a time per process."""

    compiles: list[KernelCompile] = field(default_factory=list)
    available: bool = False
    _previous: Any = None
    _runtime: Any = None

    def __enter__(self) -> CompileWatch:
        self._runtime = _runtime_knobs()
        self.available = self._runtime is not None
        if self._runtime is not None:
            self._previous = self._runtime.jit_post_compile_hook
            self._runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous
            self._runtime = None

    def _hook(self, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        # Triton names a kernel by its qualified name ("module.fn", "test.<locals>.fn"): keep the
        # function's own name, the one its source and a profile show.
        name = str(getattr(fn, "name", None) or kwargs.get("repr", "?")).split("[")[0].rsplit(".", 1)[-1]
        details = kwargs.get("compile") or {}  # (Triton 3.6 passes the compile's options here)
        configs = kwargs.get("configs") or details.get("configs") or [None]
        attrs = "" if configs[0] is None else str(configs[0])
        key = kwargs.get("key")
        if key:  # the kernel cache's key: every argument's type and specialization
            attrs = f"{attrs} key={key}" if attrs else f"key={key}"
        self.compiles.append(KernelCompile(name, str(kwargs.get("repr", "")), time.perf_counter(), attrs))
        return self._previous(**kwargs) if self._previous is not None else None

    def names(self) -> list[str]:
        """The compiled kernels' names, in order (one per compile)."""
        return [c.name for c in self.compiles]

    def summary(self) -> dict[str, Any]:
        """For a JSON report: whether the hook was there, how many compiles, and each one."""
        return {
            "available": self.available,
            "count": len(self.compiles),
            "compiles": [{"name": c.name, "signature": c.signature, "attrs": c.attrs} for c in self.compiles],
        }
