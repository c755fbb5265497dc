"""The Hopper MLA prefill kernel (attention/triton_kernels/mla_prefill_hopper.py) compiles for
sm_90 without a GPU, in the forms it is launched in (DeepSeek-V3's widths n = v = 128, e = 64
and half of them, bf16 and fp16, with and without the output's TMA store): warp-specialized,
both halves of S as asynchronous warpgroup MMAs, the turn barriers, TMA loads, and shared
memory within the H200's 227 KiB. Skipped where this Triton has no Gluon."""

from __future__ import annotations

import pytest

from attention.triton_kernels.prefill_hopper import _GLUON
from tests.child_env import compile_report

pytestmark = pytest.mark.skipif(not _GLUON, reason="this Triton has no Gluon warp specialization (needs >= 3.6)")

_SCRIPT = r"""
import json
import torch
from tests.gluon_compile import compile_sm90
from attention.triton_kernels import mla_prefill_hopper as m

report = {}
forms = [(dtype, 128, 64, True) for dtype in (torch.bfloat16, torch.float16)]
forms += [(torch.bfloat16, 64, 32, True), (torch.bfloat16, 128, 64, False)]
for dtype, nope, rope, out_tma in forms:
    heads = 16
    query = torch.empty(64, heads, nope + rope, dtype=dtype)
    kv = torch.empty(64, heads, 2 * nope, dtype=dtype)
    key_pe = torch.empty(64, 512 + rope, dtype=dtype)[:, 512:]
    out = torch.empty(64, heads, nope, dtype=dtype)
    names = ("qn_desc", "qp_desc", "kn_desc", "kp_desc", "v_desc", "o_desc")
    descs = dict(zip(names, m._mla_descriptors(query, kv, key_pe, out, nope)))
    fn = m._mla_prefill_hopper_kernel
    consts = dict(NUM_HEADS=heads, NOPE=nope, ROPE=rope, VDIM=nope, BLOCK_M=m.MLA_HOPPER_BLOCK_M, BLOCK_N=m._BLOCK_N,
                  K_STAGES=m._K_STAGES, V_STAGES=m._V_STAGES, OUT_TMA=out_tma)
    k = compile_sm90(fn, descs, consts, "*bf16" if dtype == torch.bfloat16 else "*fp16")
    ptx = k.asm["ptx"]
    report[f"{dtype}-{nope}-{rope}-{out_tma}"] = {
        "out_tma": out_tma,
        "shared": k.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma_load": ptx.count("cp.async.bulk.tensor.2d.shared"),
        "tma_store": ptx.count("cp.async.bulk.tensor.2d.global.shared"),
        "setmaxnreg": ptx.count("setmaxnreg"),
        "turns": sum(ptx.count(s) for s in ("bar.sync 8, 256", "bar.sync 9, 256")),
    }
print(json.dumps(report))
"""


def test_mla_hopper_prefill_compiles_for_sm90() -> None:
    report = compile_report(_SCRIPT)
    assert len(report) == 4, report
    for name, r in report.items():
        assert 0 < r["shared"] <= 232448, (name, r)  # the H200's 227 KiB per block
        assert r["wgmma"] > 0 and r["tma_load"] >= 5 and r["setmaxnreg"] > 0, (name, r)  # Q, k_nope, k_pe, V
        assert (r["tma_store"] > 0) == r["out_tma"], (name, r)
        assert r["turns"] >= 2, (name, r)
