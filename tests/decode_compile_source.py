"""The decode chunk kernel as Triton's ahead-of-time compiler takes it, for the compile tests'
child processes (which import this module without TRITON_INTERPRET): the signature, the
constants of a 32 query / 8 KV head, head_dim 128 launch, and the specialisations a launch
makes. Needs Triton's GPU compiler, so it is imported in those children only."""

from __future__ import annotations

from typing import Any

from triton.compiler import ASTSource

from attention.triton_kernels.decode_kernels import decode_items_kernel

__all__ = ["items_kernel"]


def items_kernel(
    block_size: int,
    fused: bool,
    softcap: bool = False,
    sinks: bool = False,
    q_pad: int = 1,
    tree: bool = False,
    fp8: bool = False,
    f16_dots: bool = True,
    token_major: bool = False,
    int8: bool = False,
) -> Any:
    """An ``ASTSource`` of ``decode_items_kernel`` for a bf16 query over a bf16, fp8
    (``fp8``, its dots in fp16 unless ``f16_dots`` is False) or int8 (``int8``) cache at
    ``block_size``, its V token-major with ``token_major`` (always for int8); ``fused``: the
    fused combine; ``q_pad``: new tokens per row (with ``tree``, draft-tree masks)."""
    kv = "*fp8e4nv" if fp8 else "*i8" if int8 else "*bf16"
    scale = "*fp16" if int8 else "*fp32"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": kv, "v_cache_ptr": kv, "k_scale_ptr": scale,
           "v_scale_ptr": scale, "sinks_ptr": "*fp32", "tree_ptr": "*i32", "block_tables_ptr": "*i32",
           "items_ptr": "*i32", "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
           "counters_ptr": "*i32", "qk_scale": "fp32", "softcap": "fp32", "window": "i32"}  # fmt: skip
    for name in ("num_item_slots", "num_table_rows", "table_width", "num_blocks", "num_q_tokens",
                 "num_partial_slots", "num_counter_rows", "stride_qt", "stride_qh", "stride_bt",
                 "stride_ot", "stride_oh"):  # fmt: skip
        sig[name] = "i32"
    consts = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, G_PAD=4, Q_PAD=q_pad, M_PAD=max(16, 4 * q_pad),
                  HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=block_size, BLOCK_N=128 if fp8 or int8 else 64,
                  BLOCK_STRIDE=(block_size + (2 * block_size + 127) // 128 if int8 else block_size) * 8 * 128,
                  KV_SCALED=fp8, TOKEN_SCALES=int8,
                  F16_DOTS=fp8 and f16_dots, UPCAST=False,
                  DOT_PRECISION="tf32", FUSED_COMBINE=fused, MERGE_CHUNKS=32, SOFTCAP=softcap, SINKS=sinks,
                  TREE=tree, V_TOKEN_MAJOR=token_major or int8)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    # What a launch specialises on: 16-byte aligned pointers (0-12) and strides divisible by
    # 16 (stride_qt, stride_qh, stride_ot, stride_oh); without it no load is vectorised.
    aligned = [*range(13), 23, 24, 26, 27]
    return ASTSource(
        decode_items_kernel, sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in aligned}
    )
