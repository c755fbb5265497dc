"""The split-warpgroup Hopper MLA decode kernel (attention/triton_kernels/mla_decode_hopper_split.py)
compiles for sm_90 without a GPU, in each form the backend launches (bf16 and fp16, blocks of
64 and 128; slot plans: a direct plan runs the two-tile kernel):

- its warpgroup MMAs: for S, warpgroup 0's 16 + 4 k-steps (its channel half and the rotary
  part) and warpgroup 1's 16; for P V, each warpgroup's 4 m64 blocks x 4 k-steps (68 in all,
  as the single-warpgroup kernel);
- its TMA loads, all in the producer: a segment's query (3 boxes) and a tile (3 boxes);
- its shared memory within the H200's 227 KiB (the ring, two queries, the partial scores, P);
- no register spill (each consumer warpgroup's tile loop is near its register limit: a direct
  plan's normalized store, tried, spilled inside it).

Skipped where this Triton has no Gluon."""

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
from attention.triton_kernels import mla_decode_hopper_split as ms

report = {}
for dtype in (torch.bfloat16, torch.float16):
    for bs in (64, 128):
        q = torch.empty(8, 16, 576, dtype=dtype)
        cache = torch.empty(4, bs, 1, 576, dtype=dtype)
        descs = dict(zip(("q_desc", "qe_desc", "c_desc", "e_desc"), mh._descriptors(q, cache)))
        consts = dict(HALF=256, ROPE=64, BLOCK_H=16, BLOCK_N=64, BLOCK_SIZE=bs, STAGES=ms.SPLIT_STAGES, DIRECT=False)
        elem = "*bf16" if dtype == torch.bfloat16 else "*fp16"
        types = {"acc_ptr": "*fp32", "ml_ptr": "*fp32"}
        k = compile_sm90(ms._mla_hopper_split_kernel, descs, consts, elem, types=types)
        report[f"{dtype}-{bs}"] = kernel_report(k)
print(json.dumps(report))
"""


def test_mla_decode_hopper_split_compiles_for_sm90() -> None:
    report = compile_report(_SCRIPT)
    assert len(report) == 4, report
    for name, r in report.items():
        assert 0 < r["shared"] <= 232448, (name, r)
        # S: (16 + 4) + 16 k-steps of m64n16k16; P V: 2 warpgroups x 4 m64 blocks x 4 k-steps.
        assert r["wgmma"] == 36 + 32, (name, r)
        assert r["tma_load"] == 3 + 3, (name, r)
        assert r["loop_spill_ops"] == 0 and r["spills"] <= 0, (name, r)
