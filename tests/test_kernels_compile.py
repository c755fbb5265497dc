"""The fused boundary kernel and its token-major V runs, MLA's latent boundary, the 8-bit block dequantization (per
launch and counted on a fixed grid), the prefill kernel (its launch per tile and its persistent fixed-grid form), the
MLA decode kernels (split and balanced schedules, bf16 and fp8 latents) and the model's
elementwise kernels compile for the H200 (sm_90) without a
GPU (as tests/test_decode_compile.py does for the decode kernels): Triton's GPU compiler
rejects programs its CPU interpreter runs (a name bound to two types in the branches of an
``if``, say), so the interpreter tests alone would let such a kernel reach the GPU."""

from __future__ import annotations

import pytest

from tests.child_env import compile_report

_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attention.triton_kernels.rotary_write import _rotary_write_kernel, _value_runs_kernel
from examples.model.triton_ops import _rms_norm_kernel, _silu_mul_kernel
from attention.triton_kernels.prefill import _prefill_kernel
from attention.triton_kernels.mla_decode import _mla_decode_kernel, _mla_merge_kernel
from attention.triton_kernels.mla_balanced import _mla_balanced_kernel, _mla_balanced_merge_kernel
from attention.triton_kernels.dequantize_blocks import _dequantize_blocks_kernel
from attention.triton_kernels.latent_write import _latent_boundary_kernel

def source(fn, sig, consts):
    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    return ASTSource(fn, sig, constexprs=consts)

def rotary(dtype, cache, quantize, int8=False, rotate=False):
    scale = "*fp16" if int8 else "*fp32"
    sig = {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "q_out_ptr": dtype, "k_cache_ptr": cache,
           "v_cache_ptr": cache, "slot_ptr": "*i64", "pos_ptr": "*i64", "table_ptr": "*fp32",
           "k_scale_ptr": scale, "v_scale_ptr": scale, "k_centre_ptr": "*fp32", "rot_ptr": dtype, "num_tokens": "i32",
           "num_slots": "i64", "max_positions": "i32"}
    for name in ("stride_sb", "stride_st", "stride_sh",
                 "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
                 "stride_oh", "stride_cb", "stride_ct", "stride_ch", "stride_vb", "stride_vs", "stride_vc",
                 "stride_vd"):
        sig[name] = "i32"
    consts = dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, HALF_PAD=64, BLOCK_H=32, KV_BLOCK_H=16 if rotate else 8,
                  Q_CHUNKS=1, BLOCK_SIZE=256, QUANTIZE=quantize, TOKEN_SCALES=int8, CENTRE_K=int8 and not rotate,
                  ROTATE=rotate, VALUE_RUN=32 if cache in ("*fp8e4nv", "*i8") else 0, INTERPRETED=False)
    return source(_rotary_write_kernel, sig, consts)

def latent(dtype, cache, pairs, rows=True):
    sig = {"q_latent_ptr": dtype, "q_pe_ptr": dtype, "latent_ptr": dtype, "key_pe_ptr": dtype, "query_ptr": dtype,
           "cache_ptr": cache, "slot_ptr": "*i64", "pos_ptr": "*i64", "rows_ptr": "*i32" if rows else "*i64",
           "cos_sin_ptr": "*fp32", "scale_ptr": "*fp32",
           "num_heads": "i32", "num_slots": "i64", "max_position": "i32"}
    for name in ("stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_lt", "stride_kt", "stride_cb",
                 "stride_ct"):
        sig[name] = "i32"
    consts = dict(RANK=512, RANK_PAD=512, HALF=32, HALF_PAD=32, BLOCK_H=8, BLOCK_SIZE=64, PAIRS=pairs,
                  QUANTIZE=cache == "*fp8e4nv", HAS_ROWS=rows, INTERPRETED=False)
    return source(_latent_boundary_kernel, sig, consts)

def value_runs(dtype, cache, int8=False, rotate=False):
    scale = "*fp16" if int8 else "*fp32"
    sig = {"v_ptr": dtype, "v_cache_ptr": cache, "slot_ptr": "*i64", "v_scale_ptr": scale, "rot_ptr": dtype,
           "num_tokens": "i32", "num_slots": "i64"}
    for name in ("stride_sb", "stride_st", "stride_sh", "stride_vt", "stride_vh", "stride_vb", "stride_vs",
                 "stride_vc", "stride_vd"):
        sig[name] = "i32"
    consts = dict(HALF=64, HALF_PAD=64, BLOCK_SIZE=256, RUN=32, QUANTIZE=not int8 and cache == "*fp8e4nv",
                  TOKEN_SCALES=int8, ROTATE=rotate, INTERPRETED=False)
    return source(_value_runs_kernel, sig, consts)

def norm(dtype, add):
    sig = {"x_ptr": dtype, "residual_ptr": dtype, "weight_ptr": dtype, "out_ptr": dtype, "sum_ptr": dtype,
           "dim": "i32", "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_s": "i32"}
    return source(_rms_norm_kernel, sig, dict(ADD=add, BLOCK=4096, ROUND_BF16=False))

def silu(dtype):
    sig = {"gate_up_ptr": dtype, "out_ptr": dtype, "width": "i32", "stride_g": "i32", "stride_o": "i32"}
    return source(_silu_mul_kernel, sig, dict(BLOCK=1024, ROUND_BF16=False))

def prefill(dtype, persistent, window, softcap=False, sinks=False, cache=None, token_major=False):
    cache = cache or dtype
    int8 = cache == "*i8"
    scale = "*fp16" if int8 else "*fp32"
    sig = {"q_ptr": dtype, "k_cache_ptr": cache, "v_cache_ptr": cache, "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "tile_index_ptr": "*i32",
           "tile_count_ptr": "*i32", "out_ptr": dtype, "k_scale_ptr": scale, "v_scale_ptr": scale,
           "sinks_ptr": "*fp32", "qk_scale": "fp32", "softcap": "fp32"}
    for name in ("window", "num_blocks", "num_tokens", "table_width", "max_tiles", "stride_qt", "stride_qh",
                 "stride_bt", "stride_ot", "stride_oh"):
        sig[name] = "i32"
    consts = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=256, BLOCK_M=128,
                  BLOCK_N=128, UPCAST=False, DOT_PRECISION="tf32", HAS_WINDOW=window,
                  DEQUANT=cache != dtype and not int8, PERSISTENT=persistent, SOFTCAP=softcap, SINKS=sinks,
                  V_TOKEN_MAJOR=token_major or int8, BLOCK_STRIDE=(260 if int8 else 256) * 8 * 128, TOKEN_SCALES=int8)
    return source(_prefill_kernel, sig, consts)

def mla(dtype, cache, balanced, block_size=64, block_n=32, unrolled=0, direct=False):
    sig = {"q_ptr": dtype, "cache_ptr": cache, "table_ptr": "*i32", "rows_ptr": "*i32", "lens_ptr": "*i32"}
    sig.update({"work_ptr": "*i32"} if balanced else {})
    # The balanced schedule's partial outputs are fp16 for 16-bit queries over a 16-bit latent.
    fp16_partials = balanced and dtype in ("*bf16", "*fp16") and cache in ("*bf16", "*fp16")
    sig.update({"acc_ptr": "*fp16" if fp16_partials else "*fp32", "ml_ptr": "*fp32"})
    sig.update({"out_ptr": dtype} if balanced else {"chunk_ptr": "*i32"})
    sig["kv_scale_ptr"] = "*fp32"
    names = ("num_tokens", "num_slots") if balanced else ()
    for name in (*names, "num_rows", "num_heads", "num_blocks", "table_width"):
        sig[name] = "i32"
    sig.update({"scale_log2": "fp32", "stride_qt": "i32", "stride_qh": "i32"})
    sig.update({"stride_ot": "i32", "stride_oh": "i32"} if balanced else {})
    fp8 = cache == "*fp8e4nv"
    consts = dict(R=512, E=64, BLOCK_R=512, BLOCK_E=64, BLOCK_H=16, BLOCK_N=block_n, BLOCK_SIZE=block_size,
                  UPCAST=False, DEQUANT=fp8, F16_DOTS=fp8, DOT_PRECISION="tf32")
    if balanced:
        consts.update(UNROLLED=unrolled, DIRECT=direct)
    return source(_mla_balanced_kernel if balanced else _mla_decode_kernel, sig, consts)

def mla_merge(balanced, direct=False, hopper=False, partials="*fp16", skip_unseen=False):
    if balanced:  # hopper: as the Hopper kernel's launch takes it (a dependent launch)
        sig = {"acc_ptr": partials, "ml_ptr": "*fp32", "work_ptr": "*i32", "out_ptr": "*bf16",
               "num_tokens": "i32",
               "num_programs": "i32", "num_slots": "i32", "num_heads": "i32", "stride_ot": "i32", "stride_oh": "i32",
               "tail": "i32", "token_base": "i32"}
        return source(_mla_balanced_merge_kernel, sig, dict(R=512, BLOCK_R=512, BLOCK_TAIL=64, DIRECT=direct,
                                                             AFTER_PDL=hopper, SKIP_UNSEEN=skip_unseen))
    sig = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "lens_ptr": "*i32", "rows_ptr": "*i32", "chunk_ptr": "*i32",
           "out_ptr": "*bf16", "num_rows": "i32", "num_heads": "i32", "table_width": "i32", "splits": "i32",
           "stride_ot": "i32", "stride_oh": "i32", "tail": "i32"}
    return source(_mla_merge_kernel, sig, dict(R=512, BLOCK_R=512, BLOCK_N=32, BLOCK_SIZE=64, BLOCK_TAIL=0))

def dequant(out, int8=False, counted=False):
    cache, scale = ("*i8", "*fp16") if int8 else ("*fp8e4nv", "*fp32")
    sig = {"k_ptr": cache, "v_ptr": cache, "k_scale_ptr": scale, "v_scale_ptr": scale,
           "tables_ptr": "*i32", "sources_ptr": "*i32", "k_out_ptr": out, "v_out_ptr": out, "count_ptr": "*i32"}
    for name in ("num_scratch", "num_blocks", "num_rows", "table_width", "stride_bt", "stride_kb", "stride_kt",
                 "stride_kh", "stride_vb", "stride_vt", "stride_vh", "stride_vd", "stride_sb", "stride_st",
                 "stride_sh"):
        sig[name] = "i32"
    return source(_dequantize_blocks_kernel, sig, dict(BLOCK_SIZE=256, KV_HEADS=8, HEAD_DIM=128, D_PAD=128, TOKENS=32,
                                                       TOKEN_SCALES=int8, COUNTED=counted))

target = GPUTarget("cuda", 90, 32)
kernels = {
    "dequantize-blocks-bf16": dequant("*bf16"),
    "dequantize-blocks-fp16": dequant("*fp16"),
    "dequantize-blocks-int8-bf16": dequant("*bf16", int8=True),
    "dequantize-blocks-bf16-counted": dequant("*bf16", counted=True),
    "dequantize-blocks-int8-bf16-counted": dequant("*bf16", int8=True, counted=True),
    "mla-split-bf16": mla("*bf16", "*bf16", False),
    "mla-split-fp8-per-token-pages": mla("*bf16", "*fp8e4nv", False, block_size=32, block_n=64),
    "mla-balanced-bf16-unrolled": mla("*bf16", "*bf16", True, unrolled=2),
    "mla-balanced-fp8-per-token-pages": mla("*bf16", "*fp8e4nv", True, block_size=32, block_n=64),
    "mla-balanced-bf16-direct-64-heads": mla("*bf16", "*bf16", True, direct=True),
    "mla-merge-split": mla_merge(False),
    "mla-merge-balanced": mla_merge(True, partials="*fp32"),  # (float32 queries)
    "mla-merge-balanced-direct": mla_merge(True, direct=True),
    "mla-merge-hopper": mla_merge(True, hopper=True),
    "mla-merge-hopper-skip-unseen": mla_merge(True, hopper=True, skip_unseen=True),  # (eager decompressed steps)
    "mla-merge-balanced-direct-skip-unseen": mla_merge(True, direct=True, skip_unseen=True),
    "mla-merge-hopper-fp32": mla_merge(True, hopper=True, partials="*fp32"),  # (fp8 latents, the split form)
    "rotary-bf16": rotary("*bf16", "*bf16", False),
    "rotary-fp16": rotary("*fp16", "*fp16", False),
    "rotary-fp32": rotary("*fp32", "*fp32", False),
    "rotary-bf16-fp8-cache": rotary("*bf16", "*fp8e4nv", True),
    "rotary-bf16-int8-cache": rotary("*bf16", "*i8", False, int8=True),
    "rotary-bf16-rotated": rotary("*bf16", "*bf16", False, rotate=True),
    "rotary-fp32-rotated": rotary("*fp32", "*fp32", False, rotate=True),
    "rotary-bf16-int8-cache-rotated": rotary("*bf16", "*i8", False, int8=True, rotate=True),
    "rotary-bf16-fp8-cache-rotated": rotary("*bf16", "*fp8e4nv", True, rotate=True),
    "latent-boundary-bf16-pairs": latent("*bf16", "*bf16", True),
    "latent-boundary-bf16-fp8-latent": latent("*bf16", "*fp8e4nv", True),
    "latent-boundary-fp32-halves": latent("*fp32", "*fp32", False),
    "latent-boundary-bf16-no-rows": latent("*bf16", "*bf16", False, rows=False),
    "value-runs-bf16-fp8-cache": value_runs("*bf16", "*fp8e4nv"),
    "value-runs-bf16-int8-cache": value_runs("*bf16", "*i8", int8=True),
    "value-runs-bf16-fp8-cache-rotated": value_runs("*bf16", "*fp8e4nv", rotate=True),
    "value-runs-bf16-int8-cache-rotated": value_runs("*bf16", "*i8", int8=True, rotate=True),
    "norm-bf16": norm("*bf16", False),
    "add-norm-bf16": norm("*bf16", True),
    "add-norm-fp32": norm("*fp32", True),
    "silu-bf16": silu("*bf16"),
    "silu-fp16": silu("*fp16"),
    "prefill-bf16": prefill("*bf16", False, False),
    "prefill-bf16-persistent": prefill("*bf16", True, False),
    "prefill-bf16-persistent-window": prefill("*bf16", True, True),
    "prefill-bf16-window-softcap": prefill("*bf16", False, True, True),
    "prefill-bf16-persistent-sinks": prefill("*bf16", True, False, False, True),
    "prefill-fp8-token-major": prefill("*bf16", False, False, cache="*fp8e4nv", token_major=True),
    "prefill-fp8-token-major-window": prefill("*bf16", True, True, cache="*fp8e4nv", token_major=True),
    "prefill-int8-persistent-window": prefill("*bf16", True, True, cache="*i8"),
    # fp16 queries: V (and P) become bf16, not the query's dtype (paging.int8_values).
    "prefill-int8-fp16-window": prefill("*fp16", False, True, cache="*i8"),
}
report = {}
for name, src in kernels.items():
    warps = 8 if name.startswith("prefill") else 4
    k = triton.compile(src, target=target, options=dict(num_warps=warps, num_stages=3))
    report[name] = {"shared": k.metadata.shared, "ptx_lines": k.asm["ptx"].count(chr(10)),
                    "gdc_waits": k.asm["ptx"].count("griddepcontrol.wait")}
print(json.dumps(report))
"""


def test_boundary_and_model_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    report = compile_report(_SCRIPT)
    assert len(report) == 48, report
    # Only the merge the Hopper kernels launch dependent on them waits for that kernel.
    waiting = {name for name, r in report.items() if r["gdc_waits"]}
    assert waiting == {"mla-merge-hopper", "mla-merge-hopper-fp32", "mla-merge-hopper-skip-unseen"}, report
