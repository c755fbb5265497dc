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
import json, os, re, sys
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # the hook is what is tested: no cached binary may answer
sys.path.insert(0, "benchmarks")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attention.triton_kernels.decode_kernels import decode_items_kernel
from query_in_registers import keep_query_in_registers

def fp8_items():
    sig = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32",
           "v_scale_ptr": "*fp32", "sinks_ptr": "*fp32", "tree_ptr": "*i32", "block_tables_ptr": "*i32",
           "items_ptr": "*i32", "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
           "counters_ptr": "*i32", "qk_scale": "fp32", "softcap": "fp32", "window": "i32"}
    for name in ("num_item_slots", "num_table_rows", "table_width", "num_blocks", "num_q_tokens",
                 "num_partial_slots", "num_counter_rows", "stride_qt", "stride_qh", "stride_bt",
                 "stride_ot", "stride_oh"):
        sig[name] = "i32"
    consts = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, G_PAD=4, Q_PAD=1, M_PAD=16, HEAD_DIM=128, D_PAD=128,
                  BLOCK_SIZE=256, BLOCK_N=128, BLOCK_STRIDE=256 * 8 * 128, KV_SCALED=True, TOKEN_SCALES=False,
                  F16_DOTS=True, UPCAST=False, DOT_PRECISION="tf32", FUSED_COMBINE=False, MERGE_CHUNKS=32,
                  SOFTCAP=False, SINKS=False, TREE=False, V_TOKEN_MAJOR=True)
    sig.update(dict.fromkeys(consts, "constexpr"))
    aligned = [*range(13), 23, 24, 26, 27]
    return ASTSource(decode_items_kernel, sig, constexprs=consts,
                     attrs={(i,): [["tt.divisibility", 16]] for i in aligned})

def query_loads(options, hooked):
    options = dict(num_warps=4, num_stages=4, **options)
    if hooked:
        with keep_query_in_registers():
            k = triton.compile(fp8_items(), target=GPUTarget("cuda", 90, 128), options=options)
    else:
        k = triton.compile(fp8_items(), target=GPUTarget("cuda", 90, 128), options=options)
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
