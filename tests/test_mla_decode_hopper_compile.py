"""The Hopper MLA decode kernel (attention/triton_kernels/mla_decode_hopper.py) and its fp8 forms
(mla_decode_hopper_fp8.py, mla_decode_hopper_fp8_ws.py, below) compile for sm_90 without a GPU.
The 16-bit kernel in each form the backend launches (bf16 and fp16, blocks of 64 and 128, slot
and direct plans): warpgroup MMAs (3 for S, 2 x 4 for P V per tile, unrolled over k), its TMA
loads (the query's 3 boxes, the ring's 2 prologue tiles and the loop's next tile, 3 boxes each),
shared memory within the H200's 227 KiB, and no register spills in the slot form (the direct
form's extra stores after the tile loop spill 12 bytes with Triton 3.9, none with 3.6), with
fp16 partial outputs and the trigger for the merge's dependent launch, as the backend launches
it; and its softmax maxima behind one barrier (``ONE_BARRIER_MAX``) against the form without.
Skipped where this Triton has no Gluon."""

from __future__ import annotations

import functools

import pytest

from attention.triton_kernels.prefill_hopper import _GLUON
from tests.child_env import compile_report

pytestmark = pytest.mark.skipif(not _GLUON, reason="this Triton has no Gluon (needs >= 3.6)")

_SCRIPT = r"""
import json
from pathlib import Path
import torch
from triton.backends.nvidia.compiler import get_ptxas
from tests.gluon_compile import compile_sm90, kernel_report, loop_op_count
from attention.triton_kernels import mla_decode_hopper as mh

cuobjdump = str(Path(get_ptxas(90).path).parent / "cuobjdump")


def loop_sync_counts(k):  # the tile loop's barriers and shuffles (the one-barrier comparison below)
    return {"loop_barriers": loop_op_count(k.asm["cubin"], cuobjdump, r"\bBAR\.SYNC"),
            "loop_shuffles": loop_op_count(k.asm["cubin"], cuobjdump, r"\bSHFL\.")}


def compile_form(dtype, bs, direct, fused=False, tail=0, one_barrier=False):  # the two-tile kernel, 16 heads
    q = torch.empty(8, 16, 576, dtype=dtype)
    cache = torch.empty(4, bs, 1, 576, dtype=dtype)
    descs = dict(zip(("q_desc", "qe_desc", "c_desc", "e_desc"), mh._descriptors(q, cache)))
    consts = dict(HALF=256, ROPE=64, BLOCK_H=16, BLOCK_N=64, BLOCK_SIZE=bs, STAGES=mh._STAGES, DIRECT=direct,
                  FUSED=fused, BLOCK_TAIL=tail, ONE_BARRIER=one_barrier)
    elem = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    return compile_sm90(mh._mla_hopper_kernel, descs, consts, elem,
                        types={"acc_ptr": "*fp16", "ml_ptr": "*fp32", "tail": "i32"})


report = {}
for dtype in (torch.bfloat16, torch.float16):
    for bs in (64, 128):
        for direct in (False, True):
            k = compile_form(dtype, bs, direct)
            r = kernel_report(k)
            r["early_dependents"] = k.asm["ptx"].count("griddepcontrol.launch_dependents")
            if dtype == torch.bfloat16 and bs == 64 and not direct:  # the one-barrier form's twin
                r.update(loop_sync_counts(k))
            report[f"{dtype}-{bs}-{direct}"] = r
# The merge in the kernel (fused_merge), as the backend would launch it: slots, a 64-channel tail.
for direct in (False, True):
    k = compile_form(torch.bfloat16, 64, direct, fused=True, tail=64)
    r = kernel_report(k)
    ptx = k.asm["ptx"]
    r["atomics"] = ptx.count("atom.")
    r["atomics_acq_rel"] = ptx.count("atom.global.gpu.acq_rel.add.u32")
    r["cg_loads"] = ptx.count("ld.global.cg")
    report[f"fused-{direct}"] = r
# The softmax's maxima behind one barrier (ONE_BARRIER_MAX): bf16, blocks of 64, slots.
k = compile_form(torch.bfloat16, 64, False, one_barrier=True)
report["one-barrier"] = {**kernel_report(k), **loop_sync_counts(k)}
print(json.dumps(report))
"""


def test_mla_decode_hopper_compiles_for_sm90() -> None:
    report = compile_report(_SCRIPT)
    assert len(report) == 11, report
    plain, one = report["torch.bfloat16-64-False"], report.pop("one-barrier")
    # ONE_BARRIER_MAX: a round of shuffles fewer in the tile loop and a barrier fewer under Triton
    # 3.6 (whose gl.max over the latents takes two; 3.9's takes one), nothing spilled.
    assert 0 < one["loop_barriers"] <= plain["loop_barriers"], (plain, one)
    assert one["loop_shuffles"] < plain["loop_shuffles"], (plain, one)
    assert one["spills"] == 0 and one["wgmma"] == plain["wgmma"] and one["shared"] <= 232448, one
    fused = {name: report.pop(name) for name in ("fused-False", "fused-True")}
    for name, r in fused.items():  # the merge in the kernel: a counter a (split token, head), merged past L1
        assert 0 < r["shared"] <= 232448 and r["wgmma"] == 36 + 32 and r["tma_load"] == 3 + 3 * 3, (name, r)
        # Two tokens (a program's first and last) x 32 elements a thread of the counting tensor.
        assert r["atomics"] == r["atomics_acq_rel"] == 64 and r["cg_loads"] >= 3, (name, r)
        assert r["loop_spill_ops"] <= 0 and r["spills"] <= 64, (name, r)
    for name, r in report.items():
        assert 0 < r["shared"] <= 232448, (name, r)
        # S: 2 x 16 + 4 k-steps of m64n16k16; P V: 2 accumulators x 4 m64 blocks x 4 k-steps.
        assert r["wgmma"] == 36 + 32, (name, r)
        assert r["tma_load"] == 3 + 3 * 3, (name, r)
        assert r["early_dependents"] == 1, (name, r)  # the merge's programs may start at once
        assert r["spills"] == 0 if name.endswith("False") else 0 <= r["spills"] <= 32, (name, r)


_FP8_SCRIPT = r"""
import json
import torch
from tests.gluon_compile import compile_sm90, kernel_report
from attention.triton_kernels import mla_decode_hopper_fp8 as mf
from attention.triton_kernels import mla_decode_hopper_fp8_ws as mw

forms = [("fp8", mf._mla_hopper_fp8_kernel, mf.FP8_STAGES, direct) for direct in (False, True)]
forms += [("fp8-ws", mw._mla_hopper_fp8_ws_kernel, mw.FP8_WS_STAGES, direct) for direct in (False, True)]
report = {}
for bs in (64, 256):
    for name, kernel, stages, direct in forms:
        cache = torch.empty(4, bs, 1, 576, dtype=torch.float8_e4m3fn)
        descs = dict(zip(("c_desc", "e_desc"), mf.fp8_descriptors(cache, 512, 64)))
        consts = dict(HALF=256, ROPE=64, BLOCK_H=16, BLOCK_N=64, BLOCK_SIZE=bs, STAGES=stages, DIRECT=direct)
        k = compile_sm90(kernel, descs, consts, "*bf16",
                         types={"acc_ptr": "*fp32", "ml_ptr": "*fp32", "q_ptr": "*bf16", "kv_scale_ptr": "*fp32"})
        r = kernel_report(k)
        ptx = k.asm["ptx"]
        r["fp8_mma"] = ptx.count("wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3")
        r["f16_mma"] = ptx.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16")
        r["cvt"] = ptx.count("cvt.rn.f16x2.e4m3x2")
        r["early_dependents"] = ptx.count("griddepcontrol.launch_dependents")
        r["setmaxnreg"] = ptx.count("setmaxnreg")
        report[f"{name}-{bs}-{direct}"] = r
print(json.dumps(report))
"""


@functools.cache
def _fp8_report() -> dict[str, dict[str, int]]:
    """Both fp8 kernels compiled once (one child process) for the two tests below."""
    return compile_report(_FP8_SCRIPT)


def test_the_fp8_form_compiles_for_sm90() -> None:
    """attention/triton_kernels/mla_decode_hopper_fp8.py (blocks of 64 and 256, slot and direct
    plans; opt-in, ``launch_mla_hopper(..., fp8_one_warpgroup=True)``): the scores as fp8 MMAs (each of the tile's parts
    against the query's hi and lo: 2 x (2 x 8 + 2) m64n16k32), P V as fp16 MMAs over the converted
    channels (2 x 4 x 4 m64n16k16), the conversion one instruction a pair of values, the ring's
    TMA loads, shared memory within 227 KiB, few spills (the loop itself checked on the GPU for
    speed)."""
    report = {name: r for name, r in _fp8_report().items() if name.startswith("fp8-") and "-ws-" not in name}
    assert len(report) == 4, report
    for name, r in report.items():
        assert 0 < r["shared"] <= 232448, (name, r)
        assert r["fp8_mma"] == 36 and r["f16_mma"] == 32 and r["wgmma"] == 68, (name, r)
        assert r["cvt"] >= 2 * 64 * 256 // 128 // 2, (name, r)  # a tile's 512 channels, per thread, in pairs
        assert r["tma_load"] == 3 * 3, (name, r)  # the ring's 2 prologue tiles and the loop's next, 3 boxes each
        assert r["early_dependents"] == 1, (name, r)
        assert r["spills"] <= 128, (name, r)


def test_the_partitioned_fp8_form_compiles_for_sm90() -> None:
    """attention/triton_kernels/mla_decode_hopper_fp8_ws.py (slot and direct plans, blocks of 64
    and 256): the same MMAs as the one-warpgroup fp8 form, the loader's 3 TMA boxes a tile,
    registers shared out among the partitions (setmaxnreg), shared memory within 227 KiB (220 KiB
    of buffers), few spills."""
    report = {name: r for name, r in _fp8_report().items() if name.startswith("fp8-ws-")}
    assert len(report) == 4, report
    for name, r in report.items():
        assert 0 < r["shared"] <= 232448, (name, r)
        assert r["fp8_mma"] == 36 and r["f16_mma"] == 32 and r["wgmma"] == 68, (name, r)
        assert r["cvt"] >= 2 * 64 * 256 // 128 // 2, (name, r)
        assert r["tma_load"] == 3, (name, r)
        assert r["setmaxnreg"] > 0, (name, r)
        # Direct plans' outputs stored from the MMA's registers spilled 28-40 bytes (0.92x the speed).
        assert r["spills"] <= 16, (name, r)
