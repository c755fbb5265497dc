"""The Hopper prefill kernel (attention/triton_kernels/prefill_hopper.py) compiles for sm_90
without a GPU, in each form the backend launches (head_dim 64 and 128, bf16 and fp16, blocks of
32, 64, 96, 128 and 256: a key tile of 4, 2, 4, 1 and 1 TMA boxes; the fixed-grid form of CUDA
graphs): warp-specialized (register reallocation per
warpgroup), its consumers' turns on named barriers 8 and 9, asynchronous warpgroup MMAs, TMA
loads, the output's TMA store (or its absence where ``out`` cannot take one), and shared memory
within the H200's 227 KiB. Skipped where this Triton has no Gluon."""

from __future__ import annotations

import pytest

from attention.triton_kernels.prefill_hopper import _GLUON
from tests.child_env import compile_report

pytestmark = pytest.mark.skipif(not _GLUON, reason="this Triton has no Gluon warp specialization (needs >= 3.6)")

_SCRIPT = r"""
import json
import torch
from tests.gluon_compile import compile_sm90
from attention.triton_kernels import prefill_hopper as ph

report = {}
forms = [(dtype, d, bs, False, True) for dtype in (torch.bfloat16, torch.float16) for d in (64, 128)
         for bs in (32, 128, 256)]
forms += [(torch.bfloat16, 128, bs, False, True) for bs in (64, 96)]
forms += [(torch.bfloat16, 128, 256, True, True), (torch.bfloat16, 128, 256, False, False)]
for dtype, d, bs, counted, out_tma in forms:
    q = torch.empty(64, 8, d, dtype=dtype)
    cache = torch.empty(4, bs, 2, d, dtype=dtype)
    descs = dict(zip(("q_desc", "k_desc", "v_desc", "o_desc"), ph._descriptors(q, cache, cache, q)))
    fn = ph._hopper_prefill_kernel
    consts = dict(NUM_HEADS=8, GROUP=4, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_M=ph.HOPPER_PREFILL_BLOCK_M,
                  BLOCK_N=ph._BLOCK_N, K_STAGES=ph._K_STAGES, V_STAGES=ph._V_STAGES, COUNTED=counted,
                  OUT_TMA=out_tma)
    k = compile_sm90(fn, descs, consts, "*bf16" if dtype == torch.bfloat16 else "*fp16")
    ptx = k.asm["ptx"]
    report[f"{dtype}-{d}-{bs}-{counted}-{out_tma}"] = {
        "out_tma": out_tma,
        "boxes": ph._BLOCK_N // ph.kv_box_rows(bs),
        "shared": k.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "tma_load": ptx.count("cp.async.bulk.tensor.2d.shared::"),  # global -> shared
        "tma_store": ptx.count("cp.async.bulk.tensor.2d.global.shared"),
        "setmaxnreg": ptx.count("setmaxnreg"),
        "turns": sum(ptx.count(s) for s in ("bar.sync 8, 256", "bar.sync 9, 256")),
    }
print(json.dumps(report))
"""


def test_hopper_prefill_compiles_for_sm90() -> None:
    report = compile_report(_SCRIPT)
    assert len(report) == 16, report
    for name, r in report.items():
        assert 0 < r["shared"] <= 232448, (name, r)  # the H200's 227 KiB per block
        assert r["wgmma"] > 0 and r["tma"] >= 3 and r["setmaxnreg"] > 0, (name, r)
        # Q's two halves, then K(0), K(j + 1) and V(j): each key tile in its boxes.
        assert r["tma_load"] == 2 + 3 * r["boxes"], (name, r)
        assert (r["tma_store"] > 0) == r["out_tma"], (name, r)  # the output's TMA store, only where asked
        assert r["turns"] >= 2, (name, r)
