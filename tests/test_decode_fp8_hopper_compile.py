"""The Hopper fp8 decode kernel (attention/triton_kernels/decode_fp8_hopper.py) compiles for sm_90
without a GPU, in the shapes it takes (head_dim 64 and 128, GQA groups of 4 to 16, blocks of 32,
64, 128 and 256, rings of 2 and 3 tiles), and compiles to what it is for:

- its dots are fp8 warpgroup MMAs (``wgmma ... e4m3.e4m3``): 2 (query hi, lo) x 2 blocks of
  64 tokens x head_dim / 32 k-steps for S, 2 (P hi, lo) x head_dim / 64 x 4 k-steps for P V;
- no ``mma.sync``, and the only fp8 -> fp16 conversions (``F2FP.F16.E4M3``, two values each)
  in the SASS are the hi parts of the query (once) and of P (each tile), whose lo parts are
  the remainders: K and V reach the tensor cores as stored (the Triton kernel converts 136
  pairs a tile);
- its TMA loads (a K and a V box for each block-sized part of a tile: the ring's prologue and
  the loop's refill), shared memory within the H200's 227 KiB, and no register spills.

Skipped where this Triton has no Gluon."""

from __future__ import annotations

import pytest

from attention.triton_kernels.prefill_hopper import _GLUON
from tests.child_env import compile_report

pytestmark = pytest.mark.skipif(not _GLUON, reason="this Triton has no Gluon (needs >= 3.6)")

_SCRIPT = r"""
import json, subprocess
from pathlib import Path
import torch
from triton.backends.nvidia.compiler import get_ptxas
from tests.gluon_compile import compile_sm90, kernel_report
from attention.triton_kernels import decode_fp8_hopper as H

cuobjdump = str(Path(get_ptxas(90).path).parent / "cuobjdump")
report = {}
for head_dim, group, block_size, stages in ((128, 4, 256, 2), (128, 4, 256, 3), (128, 16, 128, 2), (64, 8, 256, 4),
                                            (128, 4, 32, 2), (128, 8, 64, 3), (64, 4, 32, 2)):
    k_cache = torch.empty(4, block_size, 2, head_dim, dtype=torch.float8_e4m3fn)
    v_cache = torch.empty(4, 2, head_dim, block_size, dtype=torch.float8_e4m3fn).permute(0, 3, 1, 2)
    k_desc, v_desc = H._descriptors(k_cache, v_cache)
    consts = dict(NUM_HEADS=2 * group, NUM_KV_HEADS=2, GROUP=group, BLOCK_H=max(8, group), HEAD_DIM=head_dim,
                  BLOCK_N=128, BLOCK_SIZE=block_size, STAGES=stages, PART=H.tile_part(block_size))
    types = {"q_ptr": "*bf16", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "part_o_ptr": "*fp32",
             "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
    k = compile_sm90(H._decode_fp8_hopper_kernel, {"k_desc": k_desc, "v_desc": v_desc}, consts, "*bf16", types=types)
    r = kernel_report(k, "/tmp/decode_fp8_hopper_check")
    ptx = k.asm["ptx"]
    Path("/tmp/decode_fp8_hopper_check.cubin").write_bytes(k.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", "/tmp/decode_fp8_hopper_check.cubin"], capture_output=True, text=True,
                          check=True).stdout
    r.update(e4m3_wgmma=sum(1 for line in ptx.splitlines() if "wgmma.mma_async" in line and "e4m3.e4m3" in line),
             mma_sync=ptx.count("mma.sync"), f16_from_e4m3=sass.count("F2FP.F16.E4M3"), stages=stages,
             head_dim=head_dim, block_h=max(8, group), parts=128 // H.tile_part(block_size))
    report[f"d{head_dim}-g{group}-b{block_size}-s{stages}"] = r
print(json.dumps(report))
"""


def test_decode_fp8_hopper_compiles_for_sm90_to_fp8_warpgroup_mmas() -> None:
    report = compile_report(_SCRIPT)
    assert len(report) == 7, report
    for name, r in report.items():
        d = r["head_dim"]
        s_mmas = 2 * 2 * (d // 32)  # query hi/lo x two 64-token blocks x k-steps of 32 channels
        pv_mmas = 2 * (d // 64) * 4  # P hi/lo x 64-channel blocks x k-steps of 32 tokens
        assert r["wgmma"] == r["e4m3_wgmma"] == s_mmas + pv_mmas, (name, r)
        query_hi, p_hi = r["block_h"] * d // 128, r["block_h"] * 128 // 128  # values a thread converts back
        assert r["mma_sync"] == 0 and r["f16_from_e4m3"] == (query_hi + p_hi) // 2, (name, r)
        assert r["tma_load"] == 2 * r["parts"] * (r["stages"] + 1), (name, r)
        assert 0 < r["shared"] <= 232448, (name, r)
        assert r["spills"] <= 0 and r["loop_spill_ops"] <= 0, (name, r)
