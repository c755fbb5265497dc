"""The Hopper decode kernel (attention/triton_kernels/decode_hopper.py) compiles for sm_90 without
a GPU, in the forms it takes (fp8 and bf16 / fp16 caches, head_dim 64 and 128, GQA groups of 4
to 16, blocks of 32, 64, 128 and 256, rings of 2 to 4 tiles), and compiles to what it is for:

- its dots are warpgroup MMAs on the cache's type (``wgmma ... e4m3.e4m3`` for fp8): for fp8
  (``FUSED_HI_LO``, the default: the query's and P's hi and lo rows as one operand; for groups
  of up to 4 heads interleaved in 8 rows, ``PAIRED_HI_LO``), 2 blocks
  of 64 tokens x head_dim / 32 k-steps for S and head_dim / 64 x 4 k-steps for P V, and without
  it twice that (hi and lo apart; the overlapped loop always); for 16 bits, head_dim / 16 for
  S and head_dim / 64 x 4 for P V (one block of 64 tokens);
- no ``mma.sync``, and the only fp8 -> fp16 conversions (``F2FP.F16.E4M3``, two values each)
  in the SASS are the hi parts of the query (once) and of P (each tile), whose lo parts are the
  remainders: K and V reach the tensor cores as stored (the Triton kernel converts 136 pairs a
  128-token tile);
- its TMA loads (a K and a V box for each block-sized part of a tile: the ring's prologue and
  the loop's refill; and half boxes for a one-part 16-bit tile that ends in its first half; an fp8
  tile split in two parts of 64 tokens in long blocks, ``SPLIT_FP8_TILES``), and with P's hi part
  only (``FP8_P_LO`` off) half the fp8 P V MMAs and no conversion of P back; shared
  memory within the H200's 227 KiB, and no register spills;
- the paired form's softmax once a head (its column pairs summed into one): at most half the
  exp2 of the form padded to 8 heads (``PAIRED_HI_LO`` off).

Skipped where this Triton has no Gluon."""

from __future__ import annotations

import pytest

from attention.triton_kernels.prefill_hopper import _GLUON
from tests.child_env import compile_report

pytestmark = pytest.mark.skipif(not _GLUON, reason="this Triton has no Gluon (needs >= 3.6)")

_SCRIPT = r"""
import json, re
from pathlib import Path
import torch
from triton.backends.nvidia.compiler import get_ptxas
from tests.gluon_compile import compile_sm90, kernel_report, sass_text
from attention.triton_kernels import decode_hopper as H

cuobjdump = str(Path(get_ptxas(90).path).parent / "cuobjdump")
cases = [("fp8", 128, 4, 256, 2, False), ("fp8", 128, 4, 256, 3, False), ("fp8", 128, 16, 128, 2, False),
         ("fp8", 64, 8, 256, 4, False), ("fp8", 128, 4, 32, 2, False), ("fp8", 128, 8, 64, 3, False),
         ("fp8", 64, 4, 32, 2, False), ("bf16", 128, 4, 256, 2, False), ("bf16", 128, 4, 32, 3, False),
         ("fp16", 64, 16, 64, 2, False), ("fp8", 128, 4, 256, 3, True), ("fp8", 128, 4, 32, 3, True),
         ("fp8", 64, 16, 64, 2, True), ("bf16", 128, 4, 256, 3, True), ("fp16", 64, 8, 32, 2, True)]
# (split, P lo, half boxes, fused): the switches SPLIT_FP8_TILES, FP8_P_LO, HALF_BOXES and
# FUSED_HI_LO in their default positions, then in the others.
cases = [case + (False, True, False, True) for case in cases]
cases += [
    ("fp8", 128, 4, 256, 3, False, True, True, False, True), ("fp8", 64, 8, 128, 2, False, True, True, False, True),
    ("fp8", 128, 4, 256, 3, False, False, False, False, True), ("fp8", 128, 8, 32, 2, True, False, False, False, True),
    ("bf16", 128, 4, 256, 3, False, False, True, True, True), ("fp16", 64, 8, 128, 2, False, False, True, True, True),
    ("fp8", 128, 4, 256, 3, False, False, True, False, False), ("fp8", 128, 4, 32, 3, False, False, True, False, False),
    ("fp8", 64, 16, 64, 2, False, False, True, False, False),
    ("fp8", 128, 8, 256, 3, False, False, False, False, False),
    ("fp8", 128, 4, 256, 3, True, False, True, False, False),
]
# (paired): PAIRED_HI_LO on (groups up to 4 with the fused MMAs in 8 interleaved rows), then off.
cases = [case + (True,) for case in cases] + [("fp8", 128, 4, 256, 3, False, False, True, False, True, False)]
dtypes = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}
report = {}
for kind, head_dim, group, block_size, stages, overlap, split, p_lo, half, fuse, paired in cases:
    dtype = dtypes[kind]
    paired = paired and kind == "fp8" and fuse and not overlap and group <= 4
    block_h = max(4 if paired else 8, group)
    block_n = H.hopper_block_n(dtype)
    part, trim, halves = H.launch_form(block_size, dtype, overlap, split=split, half_boxes=half)
    k_cache = torch.empty(4, block_size, 2, head_dim, dtype=dtype)
    if kind == "fp8":  # V token-major, as kvcache allocates an 8-bit cache
        v_cache = torch.empty(4, 2, head_dim, block_size, dtype=dtype).permute(0, 3, 1, 2)
    else:
        v_cache = torch.empty(4, block_size, 2, head_dim, dtype=dtype)
    k_desc, v_desc = H._descriptors(k_cache, v_cache, part)
    k_half, v_half = H._descriptors(k_cache, v_cache, block_n // 2) if halves else (k_desc, v_desc)
    consts = dict(NUM_HEADS=2 * group, NUM_KV_HEADS=2, GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim,
                  BLOCK_N=block_n, BLOCK_SIZE=block_size, STAGES=stages, PART=part, OVERLAP=overlap,
                  TRIM=trim, P_LO=p_lo, FUSE=fuse)
    q = "*fp16" if kind == "fp16" else "*bf16"
    types = {"q_ptr": q, "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "part_o_ptr": "*fp32",
             "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
    descs = {"k_desc": k_desc, "v_desc": v_desc, "k_half_desc": k_half, "v_half_desc": v_half}
    k = compile_sm90(H._decode_hopper_kernel, descs, consts, q, types=types)
    r = kernel_report(k)
    ptx = k.asm["ptx"]
    sass = sass_text(k.asm["cubin"], cuobjdump)
    operand = {"fp8": "e4m3.e4m3", "bf16": "bf16.bf16", "fp16": "f16.f16"}[kind]
    r.update(typed_wgmma=sum(1 for line in ptx.splitlines() if "wgmma.mma_async" in line and operand in line),
             mma_sync=ptx.count("mma.sync"), f16_from_e4m3=sass.count("F2FP.F16.E4M3"), stages=stages,
             head_dim=head_dim, block_h=block_h, paired=paired, parts=block_n // part, fp8=kind == "fp8",
             overlap=overlap,
             p_lo=p_lo, half_boxes=halves, fused=fuse and kind == "fp8" and not overlap,
             commits=ptx.count("wgmma.commit_group"), exp2=ptx.count("ex2.approx"),
             waits=sorted(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)))
    report[f"{kind}-d{head_dim}-g{group}-b{block_size}-s{stages}" + ("-overlap" if overlap else "")
           + ("-split" if split else "") + ("" if p_lo else "-hi-only") + ("-half-boxes" if halves else "")
           + ("-fused" if fuse else "") + ("-paired" if paired else "")] = r
print(json.dumps(report))
"""


def test_decode_hopper_compiles_for_sm90_to_warpgroup_mmas_on_the_cache_type() -> None:
    report = compile_report(_SCRIPT)
    assert len(report) == 27, report
    for name, r in report.items():
        d = r["head_dim"]
        # The overlapped loop has each MMA twice in the code: S in the prologue and the loop,
        # P V in the loop and the epilogue.
        copies = 2 if r["overlap"] else 1
        if r["fp8"]:
            p_splits = 2 if r["p_lo"] else 1  # P's hi and lo parts (FP8_P_LO), or hi only
            s_calls, pv_calls = 2, p_splits * r["parts"]  # warpgroup_mma calls a tile: one commit group each
            mmas = 2 * 2 * (d // 32) + p_splits * (d // 64) * 4
            if r["fused"]:  # hi and lo rows as one operand: one chain of MMAs each for S and P V
                s_calls, pv_calls = 1, r["parts"]
                mmas = 2 * (d // 32) + (d // 64) * 4
            # Values a thread converts back: the query's hi (once; paired: every row's) and, for
            # P's lo, P's hi (each tile).
            query_rows = 2 * r["block_h"] if r["paired"] else r["block_h"]
            query_hi, p_hi = query_rows * d // 128, r["block_h"] * 128 // 128 if r["p_lo"] else 0
            assert r["f16_from_e4m3"] == (query_hi + copies * p_hi) // 2, (name, r)
        else:
            s_calls, pv_calls = 1, 1
            mmas = d // 16 + (d // 64) * 4
            assert r["f16_from_e4m3"] == 0, (name, r)
        assert r["wgmma"] == r["typed_wgmma"] == copies * mmas, (name, r)
        assert r["commits"] == copies * (s_calls + pv_calls), (name, r)
        # In turn: a wait for all after S and after P V. Overlapped: the prologue's S, the
        # loop's wait for S that leaves P V's groups running, then for P V, the epilogue's P V.
        assert r["waits"] == ([0, 0, 0, pv_calls] if r["overlap"] else [0, 0]), (name, r)
        assert r["mma_sync"] == 0, (name, r)
        # A load site's K and V boxes (with half boxes: a second form of a one-part tile's loads).
        boxes = 2 * r["parts"] + (2 if r["half_boxes"] else 0)
        assert r["tma_load"] == boxes * (r["stages"] + 1), (name, r)
        assert 0 < r["shared"] <= 232448, (name, r)
        assert r["spills"] <= 0 and r["loop_spill_ops"] <= 0, (name, r)
    # The paired form's softmax once a head: at most half the exp2 of the same kernel padded to
    # 8 heads (hi and lo in halves), but for the running max's rescale.
    paired, padded = report["fp8-d128-g4-b256-s3-fused-paired"], report["fp8-d128-g4-b256-s3-fused"]
    assert paired["exp2"] * 2 <= padded["exp2"] + 1, (paired, padded)


_WS_SCRIPT = r"""
import json, re
import torch
from tests.gluon_compile import compile_sm90, kernel_report
from attention.triton_kernels import decode_hopper as H
from attention.triton_kernels import decode_hopper_ws as W

cases = [("fp8", 128, 4, 256, 3), ("fp8", 128, 4, 32, 3), ("fp8", 64, 16, 64, 2), ("bf16", 128, 4, 256, 3),
         ("fp16", 64, 8, 128, 2)]
dtypes = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}
report = {}
for kind, head_dim, group, block_size, stages in cases:
    dtype = dtypes[kind]
    block_n = H.hopper_block_n(dtype)
    part, trim, halves = H.launch_form(block_size, dtype, False)
    k_cache = torch.empty(4, block_size, 2, head_dim, dtype=dtype)
    if kind == "fp8":
        v_cache = torch.empty(4, 2, head_dim, block_size, dtype=dtype).permute(0, 3, 1, 2)
    else:
        v_cache = torch.empty(4, block_size, 2, head_dim, dtype=dtype)
    k_desc, v_desc = H._descriptors(k_cache, v_cache, part)
    consts = dict(NUM_HEADS=2 * group, NUM_KV_HEADS=2, GROUP=group, BLOCK_H=H.hopper_block_h(group, dtype),
                  HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_SIZE=block_size, STAGES=stages, PART=part, TRIM=trim,
                  P_LO=True, FUSE=True)
    q = "*fp16" if kind == "fp16" else "*bf16"
    types = {"q_ptr": q, "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "part_o_ptr": "*fp32",
             "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
    descs = {"k_desc": k_desc, "v_desc": v_desc, "k_half_desc": k_desc, "v_half_desc": v_desc}
    k = compile_sm90(W._decode_hopper_ws_kernel, descs, consts, q, types=types, maxnreg=128)
    r = kernel_report(k)
    ptx = k.asm["ptx"]
    r.update(threads=k.metadata.num_warps * 32, head_dim=head_dim, parts=block_n // part, fp8=kind == "fp8",
             mma_sync=ptx.count("mma.sync"), commits=ptx.count("wgmma.commit_group"))
    report[f"{kind}-d{head_dim}-g{group}-b{block_size}-s{stages}"] = r
print(json.dumps(report))
"""


def test_the_loader_warp_form_compiles_for_sm90_for_two_programs_an_sm() -> None:
    """The loop in turn with its loads in a loader warp (attention/triton_kernels/decode_hopper_ws.py)
    compiles for sm_90 in the forms the loop in turn takes: the same warpgroup MMAs (fused hi / lo
    for fp8), a K and a V box a part at the loader's load site(s) (no prologue), two partitions
    of a warpgroup each at 128 registers a thread and shared memory for two programs an SM at
    three stages, no spills."""
    report = compile_report(_WS_SCRIPT)
    assert len(report) == 5, report
    for name, r in report.items():
        d = r["head_dim"]
        mmas = (2 * (d // 32) + (d // 64) * 4) if r["fp8"] else (d // 16 + (d // 64) * 4)
        calls = (1 + r["parts"]) if r["fp8"] else 2
        assert r["wgmma"] == mmas and r["commits"] == calls and r["mma_sync"] == 0, (name, r)
        # (the compiler may peel the loader's loop: a multiple of its K and V boxes a part)
        assert r["tma_load"] >= 2 * r["parts"] and r["tma_load"] % (2 * r["parts"]) == 0, (name, r)
        assert r["threads"] == 256 and r["registers"] <= 128, (name, r)
        assert 0 < r["shared"] <= (232448 // 2 if "s3" in name else 232448), (name, r)
        assert r["spills"] <= 0, (name, r)
