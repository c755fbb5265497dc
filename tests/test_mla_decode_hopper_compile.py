"""The Hopper MLA decode kernel (attention/triton_kernels/mla_decode_hopper.py) compiles for
sm_90 without a GPU, in each form the backend launches (bf16 and fp16, blocks of 64 and 128,
slot and direct plans): warpgroup MMAs (3 for S, 2 x 4 for P V per tile, unrolled over k),
its TMA loads (the query's 3 boxes, the ring's 2 prologue tiles and the loop's next tile, 3
boxes each), shared memory within the H200's 227 KiB, and no register spills in the slot form
(the direct form's extra stores after the tile loop spill 12 bytes with Triton 3.9, none with
3.6), with fp16 partial outputs and the trigger for the merge's dependent launch, as the backend
launches it. Skipped where this Triton has no Gluon."""

from __future__ import annotations

import pytest

from attention.triton_kernels.prefill_hopper import _GLUON
from tests.child_env import compile_report

pytestmark = pytest.mark.skipif(not _GLUON, reason="this Triton has no Gluon (needs >= 3.6)")

_SCRIPT = r"""
import json
import torch
from tests.gluon_compile import compile_sm90, kernel_report
from attention.triton_kernels import mla_decode_hopper as mh

report = {}
for dtype in (torch.bfloat16, torch.float16):
    for bs in (64, 128):
        for direct in (False, True):
            q = torch.empty(8, 16, 576, dtype=dtype)
            cache = torch.empty(4, bs, 1, 576, dtype=dtype)
            descs = dict(zip(("q_desc", "qe_desc", "c_desc", "e_desc"), mh._descriptors(q, cache)))
            consts = dict(HALF=256, ROPE=64, BLOCK_H=16, BLOCK_N=64, BLOCK_SIZE=bs, STAGES=mh._STAGES, DIRECT=direct)
            elem = "*bf16" if dtype == torch.bfloat16 else "*fp16"
            k = compile_sm90(mh._mla_hopper_kernel, descs, consts, elem, types={"acc_ptr": "*fp16", "ml_ptr": "*fp32"})
            r = kernel_report(k, "/tmp/mla_decode_hopper_check")
            r["early_dependents"] = k.asm["ptx"].count("griddepcontrol.launch_dependents")
            report[f"{dtype}-{bs}-{direct}"] = r
print(json.dumps(report))
"""


def test_mla_decode_hopper_compiles_for_sm90() -> None:
    report = compile_report(_SCRIPT)
    assert len(report) == 8, report
    for name, r in report.items():
        assert 0 < r["shared"] <= 232448, (name, r)
        # S: 2 x 16 + 4 k-steps of m64n16k16; P V: 2 accumulators x 4 m64 blocks x 4 k-steps.
        assert r["wgmma"] == 36 + 32, (name, r)
        assert r["tma_load"] == 3 + 3 * 3, (name, r)
        assert r["early_dependents"] == 1, (name, r)  # the merge's programs may start at once
        assert r["spills"] == 0 if name.endswith("False") else 0 <= r["spills"] <= 32, (name, r)
