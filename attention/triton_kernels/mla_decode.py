"""Paged decode for multi-head latent attention (DeepSeek's MLA), in the absorbed form.

Each token of a row caches one latent of ``D = R + E`` values (``R`` = kv_lora_rank, the
compressed K/V; ``E`` = qk_rope_head_dim, the rotated shared key) in a cache laid out
``[num_blocks, block_size, 1, D]``. A row's one new token has a query per head, also ``D``
wide (``[W_UK^T q_nope, q_pe]``), and its output is ``softmax(q . latent * scale) @
latent[:, :R]``: every head reads the same latents, so one program takes a tile of
``BLOCK_H`` heads of one row and streams the row's latents once for all of them (the K/V
bytes of MLA are one latent per token, not per head: what makes MLA decode memory-cheap).

Rows with several new tokens (prefill, extend, verification) run as one query per token:
:func:`mla_attention` takes, per query token, its row of the block table and how many latents
it sees (its position + 1: causal), and :func:`causal_queries` builds both from a step's
lengths. (Each token then streams its own prefix: fine for decode and short rows; long rows
attend decompressed instead, :mod:`attention.triton_kernels.mla_prefill`.)

Grid ``(head tiles, query tokens, splits)``: split ``s`` of a token takes the latents ``[s *
chunk, (s + 1) * chunk)``, so long rows spread over more programs. ``chunk`` is read on the
device (``split_len``), so a CUDA graph captured for a fixed grid takes each step's: the grid
can leave room for many splits and a step with short rows sets a small chunk. A split beyond
a token's latents returns at once; the others store their fp32 partial output, running max
and sum, and a second kernel merges, per token and head, only the splits its latents reach
(log-sum-exp). With ``work=``, the same inner loop (:mod:`attention.triton_kernels.mla_tiles`)
runs on a length-balanced schedule instead (:mod:`attention.triton_kernels.mla_balanced`):
faster on batches of uneven lengths, what the triton backend plans. There a token that one
program attends whole is stored by it, and only tokens split across programs take partial
outputs (at most two per program, whatever the token count).

Memory safety holds for any table: block ids outside ``[0, num_blocks)`` mask their tokens
off (never dereferenced, and out of the softmax), table columns are clamped to the table
width, and a length is clamped to ``table_width * block_size``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from attention.errors import InvalidArgumentError
from attention.triton_kernels.mla_balanced import (
    MIN_PROGRAM_LATENTS,
    MLAWork,
    launch_mla_balanced,
    min_program_latents,
    mla_work_len,
)
from attention.triton_kernels.mla_decode_hopper import (
    MLA_HOPPER_BLOCK_N,
    MLA_HOPPER_HEADS,
    launch_mla_hopper,
    mla_decode_hopper_applies,
)
from attention.triton_kernels.mla_tiles import (
    attend_latents,
    fold_partial,
    load_queries,
    store_merged,
    store_partial,
    token_extent,
)
from attention.triton_kernels.paging import (
    dot_precision_for,
    f16_dots_for,
    next_power_of_2,
    upcast_for,
)

__all__ = ["MLALaunch", "causal_queries", "default_mla_launch", "hopper_mla_launch", "mla_attention", "mla_decode",
           "mla_split_count", "mla_split_len"]  # fmt: skip

_LOG2E = 1.4426950408889634
#: The splits' fp32 partial outputs of one launch, at most (bytes).
MAX_PARTIAL_BYTES = 256 << 20


@dataclass(frozen=True)
class MLALaunch:
    """Heads per program, latents per tile, warps and pipeline stages of the MLA kernels; for
    the balanced schedule (:mod:`attention.triton_kernels.mla_balanced`) also the programs
    resident per SM (what shared memory allows) and the segments run unrolled; whether an fp8
    latent's dots run in fp16 (else in the query's dtype); ``hopper``: the balanced schedule
    runs on the Gluon kernel of :mod:`attention.triton_kernels.mla_decode_hopper` where it
    applies (else on the Triton kernel with this launch); ``hopper_ring``: that kernel's
    deeper-ring form (:mod:`attention.triton_kernels.mla_decode_hopper_ring`);
    ``hopper_split``: its split-warpgroup form (:mod:`attention.triton_kernels.mla_decode_hopper_split`);
    ``hopper_fused_merge``: the two-tile kernel merges split tokens itself, no merge launch."""

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 1
    unrolled: int = 0
    f16_fp8_dots: bool = True
    hopper: bool = False
    hopper_ring: bool = False
    hopper_split: bool = False
    hopper_fused_merge: bool = False

    def kernel_args(self) -> dict[str, int | bool]:
        """The keyword arguments :func:`mla_attention` takes from this launch."""
        return dict(block_h=self.block_h, block_n=self.block_n, num_warps=self.num_warps,
                    num_stages=self.num_stages, unrolled=self.unrolled, f16_fp8_dots=self.f16_fp8_dots,
                    hopper=self.hopper, hopper_ring=self.hopper_ring, hopper_split=self.hopper_split,
                    hopper_fused_merge=self.hopper_fused_merge)  # fmt: skip


def default_mla_launch(heads: int) -> MLALaunch:
    """Tiles of 16 heads up to 16 heads (memory-bound: one program streams a token's latents
    for all of them; 3 stages of 32 x 576 bf16 leave room for two programs per SM), else of 64
    (compute-bound: DeepSeek-V3's 128 heads on one GPU; one program per SM). The fastest
    launches of ``benchmarks/bench_mla_decode.py`` on the H200 (``results/mla-decode-2026-12-03.json``;
    the balanced schedule's: ``results/mla-decode-balanced-2026-12-04.md``). An fp8 latent's
    dots run in fp16 at 16 heads (its conversion is the cheaper one: 1.2x faster than bf16
    dots), in bf16 at 64 (the fp16 operand's clamp costs more where compute is the limit:
    1.2x slower; ``results/mla-decode-balanced-2026-12-04.json``)."""
    if heads <= 16:
        return MLALaunch(16, 32, 4, 3, programs_per_sm=2, unrolled=2, f16_fp8_dots=True)
    return MLALaunch(64, 64, 8, 2, programs_per_sm=1, unrolled=0, f16_fp8_dots=False)


def hopper_mla_launch(ring: bool = False, split: bool = False, fused_merge: bool = False) -> MLALaunch:
    """The launch of the Hopper MLA decode kernel (up to 16 heads, 64-latent tiles, one
    program an SM; :mod:`attention.triton_kernels.mla_decode_hopper`; ``ring``: its
    deeper-ring form; ``split``: its split-warpgroup form; ``fused_merge``: the merge in the
    two-tile kernel). Where that kernel does not apply to a call, the Triton balanced kernel
    runs the same schedule with 64-latent tiles and 2 stages."""
    return MLALaunch(MLA_HOPPER_HEADS, MLA_HOPPER_BLOCK_N, 4, 2, programs_per_sm=1, unrolled=0, hopper=True,
                     hopper_ring=ring, hopper_split=split, hopper_fused_merge=fused_merge)  # fmt: skip


def mla_split_count(num_tokens: int, heads: int, rank: int, block_h: int, table_len: int, num_sms: int) -> int:
    """Splits per token for a launch of this shape (a CUDA graph's grid: no lengths): enough
    programs to give every SM eight, at most ``table_len / MIN_PROGRAM_LATENTS`` and at most what
    :data:`MAX_PARTIAL_BYTES` of partial outputs hold."""
    tokens = max(1, num_tokens)
    programs = tokens * -(-heads // block_h)
    by_gpu = -(-8 * num_sms // programs)
    by_memory = MAX_PARTIAL_BYTES // (tokens * heads * rank * 4)
    return max(1, min(by_gpu, by_memory, table_len // MIN_PROGRAM_LATENTS))


def mla_split_len(longest: int, num_splits: int, heads: int, block_n: int) -> int:
    """Latents per split for a step whose longest token sees ``longest``: the splits cover it,
    and a split reads at least :func:`~attention.triton_kernels.mla_balanced.min_program_latents`."""
    chunk = max(min_program_latents(heads), -(-longest // num_splits))
    return -(-chunk // block_n) * block_n


@triton.jit(do_not_specialize=["num_rows", "table_width"])  # per-step sizes
def _mla_decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [rows, H, D]
    cache_ptr,  # [num_blocks, block_size, 1, D]
    table_ptr,  # int32 [rows, table_width]
    rows_ptr,  # int32 [T]: each query token's table row
    lens_ptr,  # int32 [T]: the latents each query token sees
    acc_ptr,  # fp32 [T, splits, H, R]
    ml_ptr,  # fp32 [T, splits, H, 2]: running max (log2 domain) and sum
    chunk_ptr,  # int32 [1]: latents per split (rounded up to a multiple of BLOCK_N)
    kv_scale_ptr,  # fp32 [1]: an fp8 latent's dequantization scale (read when DEQUANT)
    num_rows,
    num_heads,
    num_blocks,
    table_width,
    scale_log2,
    stride_qt,
    stride_qh,
    R: tl.constexpr,
    E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DEQUANT: tl.constexpr,
    F16_DOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    h0 = tl.program_id(0) * BLOCK_H
    token = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    offs_h = h0 + tl.arange(0, BLOCK_H)
    head_ok = offs_h < num_heads
    row, seq_len = token_extent(rows_ptr, lens_ptr, token, num_rows, table_width, BLOCK_SIZE)
    chunk = tl.cdiv(tl.maximum(tl.load(chunk_ptr), 1), BLOCK_N) * BLOCK_N  # as the merge rounds it
    start = split * chunk
    if start >= seq_len and split > 0:
        return  # the merge reads only the splits a token's latents reach (and split 0)
    end = tl.minimum(start + chunk, seq_len)

    q_lat, q_pe = load_queries(q_ptr, token, offs_h, head_ok, stride_qt, stride_qh, R, E, BLOCK_R, BLOCK_E, UPCAST,
                               F16_DOTS)  # fmt: skip
    kv_scale = 1.0
    if DEQUANT:
        # fp8 latents convert exactly to the query's dtype; their scale multiplies the scores
        # (here) and the output (at the end) instead of every latent.
        kv_scale = tl.load(kv_scale_ptr)
        scale_log2 = scale_log2 * kv_scale

    table_row = table_ptr + row.to(tl.int64) * table_width
    m_i, l_i, acc = attend_latents(
        q_lat, q_pe, cache_ptr, table_row, start, end, num_blocks, table_width, scale_log2, R, E, BLOCK_R, BLOCK_E,
        BLOCK_H, BLOCK_N, BLOCK_SIZE, UPCAST or DEQUANT, DOT_PRECISION,
    )  # fmt: skip

    if DEQUANT:
        acc = acc * kv_scale
    base = (token.to(tl.int64) * splits + split) * num_heads + offs_h.to(tl.int64)
    store_partial(acc_ptr, ml_ptr, base, head_ok, acc, m_i, l_i, R, BLOCK_R)


@triton.jit(do_not_specialize=["num_rows", "table_width", "splits"])
def _mla_merge_kernel(  # type: ignore[no-untyped-def]
    acc_ptr,  # fp32 [T, splits, H, R]
    ml_ptr,  # fp32 [T, splits, H, 2]
    lens_ptr,  # int32 [T]
    rows_ptr,  # int32 [T]
    chunk_ptr,  # int32 [1]
    out_ptr,  # [T, H, >= R] (channels contiguous)
    num_rows,
    num_heads,
    table_width,
    splits,
    stride_ot,
    stride_oh,
    tail,  # channels after the first R to zero
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """One (token, head): the log-sum-exp merge of the splits its latents reach (split 0
    always; a token that sees nothing gives zeros)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    _, seq_len = token_extent(rows_ptr, lens_ptr, token, num_rows, table_width, BLOCK_SIZE)
    chunk = tl.cdiv(tl.maximum(tl.load(chunk_ptr), 1), BLOCK_N) * BLOCK_N  # as the attention kernel rounds it
    used = tl.minimum(tl.maximum((seq_len + chunk - 1) // chunk, 1), splits)
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, used):
        base = (token.to(tl.int64) * splits + s) * num_heads + head
        m_run, l_run, acc = fold_partial(acc_ptr, ml_ptr, base, m_run, l_run, acc, R, BLOCK_R)
    acc = acc / tl.where(l_run > 0, l_run, 1.0)
    store_merged(out_ptr, token, head, stride_ot, stride_oh, acc, tail, R, BLOCK_R, BLOCK_TAIL)


def causal_queries(
    seq_lens: Sequence[int], query_lens: Sequence[int], skip: Collection[int] = ()
) -> tuple[list[int], list[int]]:
    """Per query token of a step (rows in order, a row's new tokens in order): its row, and
    the latents it sees (its position + 1). The tokens of rows in ``skip`` get row -1 and 0
    latents (they see nothing: attended elsewhere). Raises InvalidArgumentError for a row
    with more new tokens than latents."""
    if (
        not skip
        and len(seq_lens) == len(query_lens)
        and (not query_lens or (min(query_lens) == max(query_lens) == 1 and min(seq_lens) >= 1))
    ):  # a decode step: one token a row, seeing its whole row
        return list(range(len(seq_lens))), list(seq_lens)
    rows: list[int] = []
    lens: list[int] = []
    for r, (s_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        if not 0 <= q_len <= s_len:
            raise InvalidArgumentError(f"query_lens[{r}]: {q_len} new tokens in a row of {s_len}")
        if r in skip:
            rows += [-1] * q_len
            lens += [0] * q_len
        else:
            rows += [r] * q_len
            lens += range(s_len - q_len + 1, s_len + 1)
    return rows, lens


def mla_decode(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    **launch: Any,
) -> torch.Tensor:
    """:func:`mla_attention` for one new token per row: query [rows, H, D], seq_lens int32
    [rows] (the latents each row's token sees); keyword arguments as there."""
    rows = torch.arange(query.shape[0], dtype=torch.int32, device=query.device)
    return mla_attention(query, cache, block_tables, rows, seq_lens, **launch)


def mla_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_rows: torch.Tensor,
    token_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits: int = 1,
    split_len: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    block_n: int = 32,
    block_h: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    f16_fp8_dots: bool = True,
    out: torch.Tensor | None = None,
    work: MLAWork | None = None,
    unrolled: int = 0,
    zero_rest: bool = False,
    hopper: bool = False,
    hopper_ring: bool = False,
    hopper_split: bool = False,
    skip_unseen: bool = False,
    merge_tokens: tuple[int, int] | None = None,
    hopper_fused_merge: bool = False,
) -> torch.Tensor:
    """Absorbed MLA attention of query tokens over a paged latent cache.

    query:        [T, H, R + E] (``[W_UK^T q_nope, q_pe]`` per head), the cache's dtype (a
                  16-bit one over an fp8 cache).
    cache:        [num_blocks, block_size, 1, R + E], the latents (already holding this
                  step's); R = ``kv_lora_rank``. fp8 (float8_e4m3) with ``kv_scale``.
    block_tables: int32 [rows, table_width].
    token_rows:   int32 [T], each query token's row of the table (out of range: it sees nothing).
    token_lens:   int32 [T], the latents it sees: the first ``token_lens[t]`` of its row
                  (causal rows: :func:`causal_queries`).
    scale:        the softmax scale (``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
    num_splits:   programs per token along its latents (long rows: more parallelism).
    split_len:    int32 [1] on the device: latents per split (rounded up to a multiple of
                  ``block_n``); ``num_splits`` times that must cover the longest
                  ``token_lens`` (what lies beyond is left out, never read out of bounds). A
                  device value, so a captured graph takes each step's. Default: the table
                  width over ``num_splits``.
    kv_scale:     fp32 [1] on the device, an fp8 cache's dequantization scale (stored value
                  times scale is the latent); given exactly for an fp8 cache.
    block_n, block_h, num_warps, num_stages: the launch (latents per tile, heads per program).
    f16_fp8_dots: an fp8 latent's dots in fp16 (``paging.f16_dots_for``); False: in the
                  query's dtype (kept for comparison).
    out:          where to store, [T, H, >= R] of fp32, fp16 or bf16 with contiguous
                  channels (the first R are written, nothing else unless ``zero_rest``);
                  default a new fp32 [T, H, R].
    work:         the balanced schedule instead of splits (:mod:`attention.triton_kernels.
                  mla_balanced`: ``plan_mla_work`` over the same ``token_lens`` and
                  ``block_n``, staged, with ``work.direct`` as planned); then ``num_splits``
                  and ``split_len`` stay unset.
    unrolled:     with ``work``, a program's segments run outside its loop over tokens (0-4).
    zero_rest:    also store zeros into ``out``'s channels after the first R (the triton
                  backend's output is ``R + E`` wide; this saves it a kernel per layer).
    hopper:       with ``work`` planned with ``block_n`` 64: run the Hopper kernel where
                  :func:`~attention.triton_kernels.mla_decode_hopper.mla_decode_hopper_applies`
                  (an sm_90 GPU, <= 16 heads, a 512 + 64 latent, 16-bit or fp8 under bf16
                  queries, blocks of a multiple of 64, contiguous tensors); elsewhere the Triton
                  kernel, same result.
    hopper_ring:  with ``hopper``, the Hopper kernel's deeper-ring form
                  (:mod:`~attention.triton_kernels.mla_decode_hopper_ring`; same result).
    hopper_split: with ``hopper``, the Hopper kernel's split-warpgroup form
                  (:mod:`~attention.triton_kernels.mla_decode_hopper_split`; same result).
    hopper_fused_merge: with ``hopper``, the two-tile kernel over a 16-bit latent merges the
                  tokens split across programs itself (the last program to finish one merges
                  its slots), so no merge kernel is launched (same result; ignored with
                  ``skip_unseen`` or ``merge_tokens``, the ring and split forms, fp8). Takes a
                  ``work`` planned with its counters (``plan_mla_work(..., counters=True)``).
                  Slower than the merge launch on an H100 (0.94-0.97x,
                  benchmarks/results/mla-fused-merge-h100-2026-12-06.md), so opt-in.
    skip_unseen:  with ``work``, a token that sees nothing is not stored: its rows of ``out``
                  keep what they held (a step's tokens attending decompressed: their output
                  comes from elsewhere, and zeros for them cost a write of the whole row).
    merge_tokens: with ``work``, ``(start, stop)``: the merge runs on these tokens only, and
                  the rows of ``out`` of the tokens outside are left as they were: give it
                  where those tokens see nothing (the decompressed rows of a prefill step:
                  a program for each of their (token, head) pairs cost more than their zeros).
    Returns ``out[..., :R]``: ``softmax(q . latent * scale) @ latent[:, :R]`` per head (a
    token that sees nothing gives zeros, unless ``skip_unseen``). Raises InvalidArgumentError
    for tensors of the wrong shape, dtype or device, or sizes outside what the kernel takes.
    """
    if query.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1:
        raise InvalidArgumentError(
            f"query, cache: expected [tokens, heads, D] and [num_blocks, block_size, 1, D], got {list(query.shape)} "
            f"and {list(cache.shape)}"
        )
    tokens, heads, dim = query.shape
    num_blocks, block_size, _, width = cache.shape
    if width != dim or not 0 < kv_lora_rank < dim:
        raise InvalidArgumentError(
            f"kv_lora_rank: {kv_lora_rank} with a query of {dim} and a latent of {width} channels; the latent is "
            "kv_lora_rank + qk_rope_head_dim wide, as the query"
        )
    fp8 = cache.dtype == torch.float8_e4m3fn
    if (query.dtype != cache.dtype and not (fp8 and query.dtype in (torch.float16, torch.bfloat16))) or (
        query.device != cache.device
    ):
        raise InvalidArgumentError(
            f"query: {query.dtype} on {query.device}, but the cache is {cache.dtype} on {cache.device}; the query "
            "takes the cache's dtype (fp16 or bf16 over an fp8 cache) and device"
        )
    if fp8 != (kv_scale is not None) or (
        kv_scale is not None
        and (kv_scale.dtype != torch.float32 or kv_scale.device != query.device or kv_scale.numel() != 1)
    ):
        raise InvalidArgumentError(
            "kv_scale: an fp8 latent cache takes its fp32 [1] scale on the query's device, and any other none; got "
            f"{None if kv_scale is None else (kv_scale.dtype, list(kv_scale.shape))} with a {cache.dtype} cache"
        )
    for name, t in (("block_tables", block_tables), ("token_rows", token_rows), ("token_lens", token_lens)):
        if t.dtype != torch.int32 or t.device != query.device:
            raise InvalidArgumentError(
                f"{name}: expected an int32 tensor on {query.device}, got {t.dtype} on {t.device}"
            )
    if block_tables.dim() != 2 or tuple(token_rows.shape) != (tokens,) or tuple(token_lens.shape) != (tokens,):
        raise InvalidArgumentError(
            f"block_tables, token_rows, token_lens: expected [rows, width], [{tokens}] and [{tokens}], got "
            f"{list(block_tables.shape)}, {list(token_rows.shape)} and {list(token_lens.shape)}"
        )
    if block_size % block_n and block_n % block_size:
        raise InvalidArgumentError(f"block_n: {block_n} and block size {block_size} must divide one another")
    if not 1 <= num_splits <= 1024:
        raise InvalidArgumentError(f"num_splits: {num_splits} is not in [1, 1024]")
    if block_h < 16 or block_n < 16 or block_h & (block_h - 1) or block_n & (block_n - 1):
        raise InvalidArgumentError(f"block_h, block_n: {block_h}, {block_n} must be powers of two, at least 16")
    if query.stride(2) != 1 or not cache.is_contiguous():
        raise InvalidArgumentError("query, cache: the channels must be contiguous (and the cache all of it)")
    if split_len is not None and (
        split_len.dtype != torch.int32 or split_len.device != query.device or tuple(split_len.shape) != (1,)
    ):
        raise InvalidArgumentError(
            f"split_len: expected an int32 [1] tensor on {query.device}, got {split_len.dtype} "
            f"{list(split_len.shape)} on {split_len.device}"
        )
    if out is not None and (
        out.dim() != 3
        or tuple(out.shape[:2]) != (tokens, heads)
        or out.shape[2] < kv_lora_rank
        or out.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        or out.device != query.device
        or out.stride(2) != 1
    ):
        raise InvalidArgumentError(
            f"out: expected [{tokens}, {heads}, >= {kv_lora_rank}] fp32, fp16 or bf16 with contiguous channels on "
            f"{query.device}, got {list(out.shape)} {out.dtype} on {out.device} with strides {list(out.stride())}"
        )
    if work is not None:
        _check_work(work, tokens, query.device, num_splits, split_len, unrolled)
    elif skip_unseen or merge_tokens is not None:
        raise InvalidArgumentError(
            "skip_unseen, merge_tokens: take the balanced schedule (work); the split one stores every token"
        )
    if hopper_fused_merge and work is not None and not work.counters:
        raise InvalidArgumentError(
            "hopper_fused_merge: the work array has no counters; plan it with plan_mla_work(..., counters=True) "
            "and stage it as MLAWork(..., counters=True)"
        )
    if merge_tokens is not None and not (
        len(merge_tokens) == 2
        and all(isinstance(v, int) for v in merge_tokens)
        and 0 <= merge_tokens[0] <= merge_tokens[1] <= tokens
    ):
        raise InvalidArgumentError(
            f"merge_tokens: {merge_tokens!r}; expected (start, stop) with 0 <= start <= stop <= {tokens}"
        )
    rank, rope = kv_lora_rank, dim - kv_lora_rank
    tables = block_tables.contiguous()
    width_cols = tables.shape[1]
    rows, lens = token_rows.contiguous(), token_lens.contiguous()
    consts = dict(
        R=rank, E=rope, BLOCK_R=next_power_of_2(max(rank, 16)), BLOCK_E=next_power_of_2(max(rope, 16)),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_SIZE=block_size, UPCAST=upcast_for(query.dtype), DEQUANT=fp8,
        F16_DOTS=fp8 and f16_fp8_dots and f16_dots_for(query.dtype, cache.dtype),
        DOT_PRECISION=dot_precision_for(query.dtype),
    )  # fmt: skip
    if out is None:  # (the kernels store every token and head: nothing to zero)
        out = torch.empty(tokens, heads, rank, dtype=torch.float32, device=query.device)
    tail = out.shape[2] - rank if zero_rest else 0
    block_tail = next_power_of_2(tail) if tail else 0
    if work is not None:
        on_hopper = hopper and block_n == MLA_HOPPER_BLOCK_N and mla_decode_hopper_applies(query, cache, kv_lora_rank)
        if tokens and heads and on_hopper:
            launch_mla_hopper(query, cache, tables, rows, lens, work, out, scale * _LOG2E, tail=tail, kv_scale=kv_scale,
                              ring=hopper_ring, split=hopper_split, skip_unseen=skip_unseen,
                              merge_tokens=merge_tokens, fused_merge=hopper_fused_merge)  # fmt: skip
        elif tokens and heads:
            launch_mla_balanced(query, cache, tables, rows, lens, work, kv_scale, out, scale * _LOG2E, consts,
                                tail=tail, unrolled=unrolled, num_warps=num_warps, num_stages=num_stages,
                                skip_unseen=skip_unseen, merge_tokens=merge_tokens)  # fmt: skip
        return out[..., :rank]
    if split_len is None:
        per_split = -(-width_cols * block_size // num_splits)
        chunk = max(block_n, -(-per_split // block_n) * block_n)
        split_len = torch.full((1,), chunk, dtype=torch.int32, device=query.device)
    acc = torch.empty(tokens, num_splits, heads, rank, dtype=torch.float32, device=query.device)
    ml = torch.empty(tokens, num_splits, heads, 2, dtype=torch.float32, device=query.device)
    if tokens and heads:
        # Head tiles vary fastest: the programs of one token run side by side and read its
        # latents from L2 after the first, instead of from HBM once per head tile.
        grid = (triton.cdiv(heads, block_h), tokens, num_splits)
        _mla_decode_kernel[grid](
            query, cache, tables, rows, lens, acc, ml, split_len, kv_scale if kv_scale is not None else split_len,
            tables.shape[0], heads, num_blocks, width_cols, scale * _LOG2E, query.stride(0), query.stride(1),
            **consts, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        _mla_merge_kernel[(tokens, heads)](
            acc, ml, lens, rows, split_len, out, tables.shape[0], heads, width_cols, num_splits, out.stride(0),
            out.stride(1), tail, R=rank, BLOCK_R=consts["BLOCK_R"], BLOCK_N=block_n, BLOCK_SIZE=block_size,
            BLOCK_TAIL=block_tail, num_warps=4,
        )  # fmt: skip
    return out[..., :rank]


def _check_work(
    work: MLAWork, tokens: int, device: torch.device, num_splits: int, split_len: torch.Tensor | None, unrolled: int
) -> None:
    """Raises InvalidArgumentError unless ``work`` is a staged schedule for ``tokens`` query
    tokens on ``device``, with no split arguments beside it."""
    if num_splits != 1 or split_len is not None:
        raise InvalidArgumentError(
            f"work: a balanced schedule takes no splits, got num_splits={num_splits} and split_len "
            f"{'set' if split_len is not None else 'unset'}; leave them at their defaults"
        )
    if not 1 <= work.programs <= 65535 or not 0 <= unrolled <= 4:
        raise InvalidArgumentError(
            f"work.programs, unrolled: {work.programs} and {unrolled}; expected [1, 65535] and [0, 4]"
        )
    want = mla_work_len(tokens, work.programs, work.counters)
    data = work.data
    if data.dtype != torch.int32 or data.device != device or tuple(data.shape) != (want,):
        raise InvalidArgumentError(
            f"work.data: expected an int32 [{want}] tensor on {device} (mla_work_len({tokens}, {work.programs}, "
            f"counters={work.counters})), got {data.dtype} {list(data.shape)} on {data.device}; plan it with "
            "plan_mla_work for these tokens"
        )
