"""The deeper-ring Hopper MLA decode kernel (attention/triton_kernels/mla_decode_hopper_ring.py)
compiles for sm_90 without a GPU, in each form the backend launches (bf16 and fp16, blocks of
64 and 128, slot and direct plans):

- the warpgroup MMAs of :mod:`.mla_decode_hopper` (3 for S, 2 x 4 for P V per tile);
- its TMA loads from the four descriptors: the query's 3 boxes where the program starts and
  where a segment's last S is done; the prologue's 5 halves (3 first halves with their rotary
  part, 2 second halves); in the loop, a second half after the first P V MMA and a first half
  with its rotary part after the second;
- its shared memory within the H200's 227 KiB (5 halves, 3 rotary parts, the query, P);
- no register spill inside the tile loop (the shortest backward branch from after the last
  HGMMA to before the first), where a spill would sit between the MMAs of every tile. The
  spills at a segment's start and end, outside it, are allowed a few bytes.

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
from attention.triton_kernels import mla_decode_hopper_ring as mr

report = {}
for dtype in (torch.bfloat16, torch.float16):
    for bs in (64, 128):
        for direct in (False, True):
            q = torch.empty(8, 16, 576, dtype=dtype)
            cache = torch.empty(4, bs, 1, 576, dtype=dtype)
            descs = dict(zip(("q_desc", "qe_desc", "c_desc", "e_desc"), mh._descriptors(q, cache)))
            consts = dict(HALF=256, ROPE=64, BLOCK_H=16, BLOCK_N=64, BLOCK_SIZE=bs, DIRECT=direct, NH=mr.HALVES,
                          NE=mr.ROPES)
            elem = "*bf16" if dtype == torch.bfloat16 else "*fp16"
            k = compile_sm90(mr._mla_hopper_ring_kernel, descs, consts, elem,
                             types={"acc_ptr": "*fp16", "ml_ptr": "*fp32"})
            report[f"{dtype}-{bs}-{direct}"] = kernel_report(k)
print(json.dumps(report))
"""


def test_mla_decode_hopper_ring_compiles_for_sm90() -> None:
    report = compile_report(_SCRIPT)
    assert len(report) == 8, report
    for name, r in report.items():
        assert 0 < r["shared"] <= 232448, (name, r)
        # S: 2 x 16 + 4 k-steps of m64n16k16; P V: 2 accumulators x 4 m64 blocks x 4 k-steps.
        assert r["wgmma"] == 36 + 32, (name, r)
        # The query twice (3 boxes), the prologue's 3 first halves (2 boxes) and 2 second
        # halves, the loop's second half and first half (1 + 2 boxes).
        assert r["tma_load"] == 2 * 3 + 3 * 2 + 2 + 3, (name, r)
        assert r["loop_spill_ops"] == 0, (name, r)
        assert 0 <= r["spills"] <= 32, (name, r)
