"""The decode kernels compile for the H200 (sm_90) without a GPU.

The interpreter runs the kernels' semantics but not Triton's GPU compiler, which rejects
things the interpreter accepts (mismatched dot operand types, unsupported masks or
atomics). Triton can compile for a target ahead of time with its bundled ptxas, no driver
needed; the kernels are decorated for the interpreter in this process (tests/conftest.py),
so the compile runs in a fresh interpreter without TRITON_INTERPRET (an fp8 cache with its
fp16 dots among the variants). It also checks that the
K/V loads are still pipelined (cp.async) in both combine modes, the fused arrival counter is
an acq_rel atomic, and the combine reads partials in 16-byte vectors. (Also compiled, by
hand, with triton 3.6, the GPU machine's version: every DECODE_SWEEP config, fp8, fp32,
head_dim 96/256, no register spills.)
"""

from __future__ import annotations

from tests.child_env import compile_report

_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attention.triton_kernels.decode_kernels import decode_combine_kernel
from tests.decode_compile_source import items_kernel

def combine_kernel(sinks=False):
    sig = {"rows_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": "*fp32", "out_ptr": "*bf16",
           "num_row_slots": "i32", "num_q_tokens": "i32", "num_partial_slots": "i32", "stride_ot": "i32",
           "stride_oh": "i32"}
    consts = dict(NUM_HEADS=32, HEAD_DIM=128, D_PAD=128, MERGE_CHUNKS=32, SINKS=sinks, Q_PAD=1)
    sig.update(dict.fromkeys(consts, "constexpr"))
    return ASTSource(decode_combine_kernel, sig, constexprs=consts,
                     attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 8, 9)})

target = GPUTarget("cuda", 90, 32)
report = {}
for name, src in (("items-bs256", items_kernel(256, False)), ("items-bs32-fused", items_kernel(32, True)),
                  ("items-bs256-softcap", items_kernel(256, False, True)),
                  ("items-bs32-fused-sinks", items_kernel(32, True, False, True)),
                  ("items-bs32-fused-q8-tree", items_kernel(32, True, q_pad=8, tree=True)),
                  ("items-bs256-q4", items_kernel(256, False, q_pad=4)),
                  ("items-bs256-fp8", items_kernel(256, False, fp8=True)),
                  ("items-bs256-fp8-bf16-dots", items_kernel(256, False, fp8=True, f16_dots=False)),
                  ("items-bs256-fp8-token-major", items_kernel(256, False, fp8=True, token_major=True)),
                  ("items-bs32-fp8-token-major", items_kernel(32, False, fp8=True, token_major=True)),
                  ("items-bs256-int8", items_kernel(256, False, int8=True)),
                  ("items-bs32-fused-int8-q4", items_kernel(32, True, q_pad=4, int8=True)),
                  ("combine", combine_kernel()),
                  ("combine-sinks", combine_kernel(True))):
    k = triton.compile(src, target=target, options=dict(num_warps=4, num_stages=2))
    ptx = k.asm["ptx"]
    report[name] = {"shared": k.metadata.shared, "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
                    "acq_rel_atomic": "atom.global.gpu.acq_rel" in ptx,
                    "conversions": len(re.findall(r"\bcvt\.", ptx)),
                    "byte_smem_reads": len(re.findall(r"ld\.shared\.b8", ptx)),
                    "vector_loads": len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx))}
print(json.dumps(report))
"""


def test_decode_kernels_compile_for_sm90() -> None:
    report = compile_report(_SCRIPT)
    kernels = ("items-bs256", "items-bs32-fused", "items-bs256-softcap", "items-bs32-fused-sinks",
               "items-bs32-fused-q8-tree", "items-bs256-q4", "items-bs256-fp8", "items-bs256-fp8-token-major",
               "items-bs32-fp8-token-major", "items-bs256-int8", "items-bs32-fused-int8-q4")  # fmt: skip
    for name in kernels:
        assert report[name]["cp_async"] > 0, f"{name}: K/V loads are no longer pipelined: {report}"
        assert report[name]["shared"] < 100 * 1024, f"{name}: shared memory grew: {report}"
    assert report["items-bs32-fused"]["acq_rel_atomic"], report
    fp16_dots, bf16_dots = report["items-bs256-fp8"], report["items-bs256-fp8-bf16-dots"]
    # fp8 K/V become the dots' fp16 in fewer conversions than bf16 takes (paging.f16_dots_for)
    assert fp16_dots["conversions"] < bf16_dots["conversions"], report
    for name in ("items-bs256-fp8-token-major", "items-bs32-fp8-token-major", "items-bs256-int8"):
        # With V's tokens contiguous, P @ V's 8-bit operand leaves shared memory in ldmatrix
        # rows, not byte by byte (attention.value_layout)
        assert report[name]["byte_smem_reads"] == 0, report
    for name in ("combine", "combine-sinks"):
        assert report[name]["vector_loads"] > 0, f"{name}: partials no longer read in 16-byte vectors: {report}"
