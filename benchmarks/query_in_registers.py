"""An experiment on Triton's pass pipeline: the decode kernel's query kept in registers.

Compiled for sm_90 with Triton 3.6 (the H200's; off the device, ``triton.compile`` plus
cuobjdump), the fp8 decode loop reloads the query tile from shared memory on every K/V tile:
at block 32, 38 ``LDS.64`` and most of the 167 register moves (``IMAD.MOV``) of the 833
instructions a 128-token tile takes (891 at block 256). The query is loop-invariant; Triton's
``ReorderInstructions`` pass moves the shared-memory load of a dot operand into the loop
whenever that load has one user inside it ("sink conversions into loops when they will
increase register pressure"), and no form of the kernel source tried avoids it (a second user
is split off by ``RemoveLayoutConversions``; a loop-carried query is converted on every tile).
Without that pass the loop takes 730 instructions at block 32 (223 registers: two programs an
SM instead of three) and 792 at block 256 (191 registers, four stages: the two programs an SM
the default launch has). Whether that is faster is a GPU question: ``bench_decode.py
--query-in-registers`` times it (benchmarks/results/decode-query-registers-compile-2026-12-05.md).

:func:`keep_query_in_registers` installs a Triton stages hook that compiles
``decode_items_kernel`` without ``ReorderInstructions`` for launches that set ``maxnreg``
(``DecodeConfig.maxnreg``), which the default launches never do; every other kernel and launch
compiles as before. Triton 3.6 does not key its cache on the hook, so use a fresh
``TRITON_CACHE_DIR`` for a run that installs it (3.9 keys on :data:`PIPELINE_KEY`). A benchmark
tool, not a serving path: it replaces any hook installed before it until it is removed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["KERNEL", "PIPELINE_KEY", "keep_query_in_registers", "stages_hook"]

#: The kernel whose pipeline the hook changes (its MLIR function name).
KERNEL = "decode_items_kernel"
#: What Triton 3.9 adds to every cache key while the hook is installed.
PIPELINE_KEY = "decode-query-in-registers-v1"


def _without_reorder(make_ttgir: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``make_ttgir`` with Triton's ``ReorderInstructions`` pass left out of the pipeline
    (for the decode kernel only; any other module compiles unchanged)."""
    from triton._C.libtriton import passes

    def make(src: Any, metadata: Any) -> Any:
        if f"@{KERNEL}" not in str(src):
            return make_ttgir(src, metadata)
        original = passes.ttgpuir.add_reorder_instructions
        passes.ttgpuir.add_reorder_instructions = lambda pm: None
        try:
            return make_ttgir(src, metadata)
        finally:
            passes.ttgpuir.add_reorder_instructions = original

    return make


def stages_hook(*args: Any) -> Any:
    """Triton's ``knobs.runtime.add_stages_inspection_hook``. Called without arguments
    (Triton 3.9, for its cache key): ``(PIPELINE_KEY, PIPELINE_KEY)``. Called with ``(backend,
    stages, options, language, capability)``: for a launch with ``maxnreg`` set, the ttgir
    stage is replaced by one without ``ReorderInstructions`` for the decode kernel."""
    if not args:
        return PIPELINE_KEY, PIPELINE_KEY
    _backend, stages, options, _language, _capability = args
    if getattr(options, "maxnreg", None) is not None and "ttgir" in stages:
        stages["ttgir"] = _without_reorder(stages["ttgir"])
    return None


@contextmanager
def keep_query_in_registers() -> Iterator[None]:
    """Install :func:`stages_hook` for the ``with`` block (the previous hook is put back
    after it). Raises RuntimeError on a Triton without the hook (before 3.5)."""
    from triton import knobs

    if not hasattr(knobs.runtime, "add_stages_inspection_hook"):
        raise RuntimeError("this Triton has no stages inspection hook (knobs.runtime.add_stages_inspection_hook)")
    previous = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = stages_hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
