"""benchmarks/query_in_registers.py: a Triton stages hook that compiles the decode kernel
without ReorderInstructions for launches that set ``maxnreg``, so the query tile stays in
registers. Checked on a compile for sm_90 (no GPU needed) in a child process: the query's
shared-memory load sits inside the K/V loop without the hook and before it with the hook and a
register cap; a launch without the cap, and any compile after the hook, as before."""

from __future__ import annotations

import sys

import pytest

from tests.child_env import ROOT, compile_report

sys.path.insert(0, str(ROOT / "benchmarks"))
from query_in_registers import PIPELINE_KEY, keep_query_in_registers, stages_hook

_SCRIPT = r"""
import contextlib, json, os, re, sys
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # the hook is what is tested: no cached binary may answer
sys.path.insert(0, "benchmarks")
import triton
from triton.backends.compiler import GPUTarget
from query_in_registers import keep_query_in_registers
from tests.decode_compile_source import items_kernel

def query_loads(options, hooked):
    options = dict(num_warps=4, num_stages=4, **options)
    with keep_query_in_registers() if hooked else contextlib.nullcontext():
        k = triton.compile(items_kernel(256, False, fp8=True, token_major=True), target=GPUTarget("cuda", 90, 128),
                           options=options)
    ttgir = k.asm["ttgir"]
    loop = ttgir.index("scf.for")
    return ["in loop" if m.start() > loop else "before" for m in re.finditer(r"%q\w* = ttg.local_load", ttgir)]

print(json.dumps({"plain": query_loads({}, False), "hooked, no cap": query_loads({}, True),
                  "hooked, cap": query_loads({"maxnreg": 255}, True), "plain after": query_loads({}, False)}))
"""


def test_the_hook_keeps_the_query_out_of_the_loop_only_for_capped_launches() -> None:
    report = compile_report(_SCRIPT)
    assert report["plain"] == ["in loop"], report
    assert report["hooked, no cap"] == ["in loop"], report
    assert report["hooked, cap"] == ["before"], report
    assert report["plain after"] == ["in loop"], report  # Triton's pipeline is put back


def test_the_hook_restores_the_previous_one_and_keys_the_cache() -> None:
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.add_stages_inspection_hook
    with keep_query_in_registers():
        assert knobs.runtime.add_stages_inspection_hook is stages_hook
    assert knobs.runtime.add_stages_inspection_hook is before
    assert stages_hook() == (PIPELINE_KEY, PIPELINE_KEY)  # Triton 3.9 asks for the key so


def test_the_hook_leaves_uncapped_stages_alone() -> None:
    class Options:
        maxnreg = None

    def ttgir(src: object, metadata: object) -> str:
        return "unchanged"

    stages = {"ttgir": ttgir}
    stages_hook(None, stages, Options(), None, 90)
    assert stages["ttgir"] is ttgir
    Options.maxnreg = 255  # type: ignore[assignment]
    stages_hook(None, stages, Options(), None, 90)
    assert stages["ttgir"] is not ttgir
    assert stages["ttgir"]("module { tt.func @other_kernel }", None) == "unchanged"  # other kernels as before
