"""Prefill / extend for multi-head latent attention (DeepSeek's MLA), decompressed.

A prompt's tokens each attend over many keys, so prefill is compute-bound, and the absorbed
form (:mod:`attention.triton_kernels.mla_decode`) costs ``2 * (r + e) / (n + e + v)`` times the
multiply-adds of ordinary attention over decompressed keys and values (3.4x for DeepSeek-V3:
``r`` 512, ``e`` 64, ``n`` 128, ``v`` 128). Here the caller decompresses instead: the keys'
latents through ``kv_b_proj`` give every head its own ``k_nope`` (``n`` channels) and value
(``v`` channels), and this kernel runs causal varlen attention with head ``h``'s key
``[k_nope[h], k_pe]``, where ``k_pe`` (``e`` channels, rotated) is the one shared by every head,
read straight from the latents (never copied per head). The two halves of ``q . k`` are two
dots of power-of-two widths (128 and 64 for DeepSeek-V3), so nothing pads 192 up to 256.

Rows: row ``b`` has ``query_lens[b]`` new tokens and ``key_lens[b]`` keys (its cached tokens
and then its new ones); new token ``i`` sees keys ``0 .. key_lens[b] - query_lens[b] + i``.

Grid ``(heads, tiles)``: one program per query head and tile of ``BLOCK_M`` new tokens of one
row (heaviest tile first, :func:`attention.triton_kernels.prefill.prefill_tile_index`). Heads
vary fastest, so the programs of one tile run side by side and share its ``k_pe`` in L2. Key
tiles left of the diagonal run unmasked; only those crossing it apply the causal mask.

On an sm_90 GPU, calls without an explicit launch ``config`` whose heads are DeepSeek-shaped
run the warp-specialized Gluon kernel of :mod:`.mla_prefill_hopper` instead (0.81-0.94x torch
SDPA on the decompressed K/V on the H200, where this kernel reaches 0.60-0.70x:
``benchmarks/results/mla-prefill-hopper-2026-12-04.json``).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.errors import InvalidArgumentError
from attention.staging import DirectStaging
from attention.triton_kernels.mla_prefill_hopper import MLA_HOPPER_BLOCK_M, mla_hopper_applies, mla_prefill_hopper
from attention.triton_kernels.paging import dot_precision_for, next_power_of_2, upcast_for
from attention.triton_kernels.prefill import prefill_tile_index

__all__ = [
    "MLAPrefillConfig",
    "MLAPrefillIndex",
    "default_mla_prefill_config",
    "mla_prefill",
    "mla_prefill_block_m",
    "stage_mla_prefill_index",
]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLAPrefillConfig:
    """Launch of :func:`mla_prefill`: query tokens per program, keys per inner step (powers of
    two, >= 16), warps and pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_mla_prefill_config(dtype: torch.dtype) -> MLAPrefillConfig:
    """16-bit: 128 x 64 tiles, 3 stages, the fastest of five launches at all six shapes of
    ``benchmarks/bench_mla_prefill.py`` on the H200 (``results/mla-prefill-2026-12-03.json``).
    fp32 (the accuracy path: three tf32 products per dot) takes small tiles."""
    if dtype == torch.float32:
        return MLAPrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    return MLAPrefillConfig()


@triton.jit
def _tile_step(  # type: ignore[no-untyped-def]
    q_nope, q_pe, kv_row, pe_row, offs_n, n0, n_end, offs_m, diag, m_i, l_i, acc,
    stride_kt, stride_pt, scale_log2,
    N: tl.constexpr, E: tl.constexpr, V: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_V: tl.constexpr,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile ``n0 + offs_n`` of the online softmax. ``kv_row`` points at key 0's
    ``k_nope`` of this head (its value follows at ``+ N``); ``pe_row`` at key 0's ``k_pe``.
    MASKED: apply the causal mask (key ``j`` visible to query row ``m`` iff ``j <= diag + m``)
    and the row end ``n_end``."""
    n = n0 + offs_n
    offs_d = tl.arange(0, N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_v = tl.arange(0, BLOCK_V)
    key_ok = n < n_end
    k_ptr = kv_row + n.to(tl.int64)[:, None] * stride_kt
    k = tl.load(k_ptr + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    pe = tl.load(pe_row + n.to(tl.int64)[:, None] * stride_pt + offs_e[None, :],
                 mask=key_ok[:, None] & (offs_e[None, :] < E), other=0.0)  # fmt: skip
    v = tl.load(k_ptr + N + offs_v[None, :], mask=key_ok[:, None] & (offs_v[None, :] < V), other=0.0)
    if UPCAST:
        k, pe, v = k.to(tl.float32), pe.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q_nope, tl.trans(k), input_precision=DOT_PRECISION)
    s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
    s = s * scale_log2
    if MASKED:
        visible = (n[None, :] <= diag + offs_m[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [T, H, N + E]
    kv_ptr,  # [Tk, H, N + V]: k_nope then value, per head
    pe_ptr,  # [Tk, >= E] with row stride stride_pt: the shared rotated key
    out_ptr,  # [T, H, V]
    q_start_ptr,  # int32 [B + 1]
    k_start_ptr,  # int32 [B + 1]
    tiles_ptr,  # int32 [num_tiles, 2]: (row, tile)
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_pt,
    stride_ot,
    stride_oh,
    N: tl.constexpr,
    E: tl.constexpr,
    V: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    item = tl.program_id(1)
    row = tl.load(tiles_ptr + item * 2)
    tile = tl.load(tiles_ptr + item * 2 + 1)
    q_start = tl.load(q_start_ptr + row)
    q_len = tl.load(q_start_ptr + row + 1) - q_start
    k_start = tl.load(k_start_ptr + row)
    k_len = tl.load(k_start_ptr + row + 1) - k_start
    diag = k_len - q_len  # query m of the row sees keys <= diag + m
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_v = tl.arange(0, BLOCK_V)
    offs_n = tl.arange(0, BLOCK_N)
    q_ok = offs_m < q_len
    q_rows = q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head.to(tl.int64) * stride_qh
    q_nope = tl.load(q_rows + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    q_pe = tl.load(q_rows + N + offs_e[None, :], mask=q_ok[:, None] & (offs_e[None, :] < E), other=0.0)
    if UPCAST:
        q_nope, q_pe = q_nope.to(tl.float32), q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    kv_row = kv_ptr + k_start.to(tl.int64) * stride_kt + head.to(tl.int64) * stride_kh
    pe_row = pe_ptr + k_start.to(tl.int64) * stride_pt
    # Keys every query of the tile sees: j <= diag + m0; the tile's last query sees up to
    # diag + m0 + BLOCK_M - 1 (capped at the row's keys).
    free_end = tl.minimum(diag + m0 + 1, k_len)
    free_end = (free_end // BLOCK_N) * BLOCK_N
    last = tl.minimum(diag + tl.minimum(m0 + BLOCK_M, q_len), k_len)
    for n0 in range(0, free_end, BLOCK_N):
        m_i, l_i, acc = _tile_step(
            q_nope, q_pe, kv_row, pe_row, offs_n, n0, k_len, offs_m, diag, m_i, l_i, acc,
            stride_kt, stride_pt, scale_log2, N, E, V, BLOCK_E, BLOCK_V, False, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(free_end, last, BLOCK_N):
        m_i, l_i, acc = _tile_step(
            q_nope, q_pe, kv_row, pe_row, offs_n, n0, k_len, offs_m, diag, m_i, l_i, acc,
            stride_kt, stride_pt, scale_log2, N, E, V, BLOCK_E, BLOCK_V, True, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = out_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(o_rows + offs_v[None, :], acc.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & (offs_v[None, :] < V))


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(torch.cuda.current_device() if device.index is None else device.index)


@dataclass(frozen=True)
class MLAPrefillIndex:
    """One step's row offsets and tile index for :func:`mla_prefill`, staged on the device once
    and passed to each layer's call (the layers of a step share their rows).

    query_lens, key_lens: the host lengths it was made from; block_m: the tile height.
    q_start, k_start: int32 [B + 1] row offsets of the query tokens and keys;
    tile_index: int32 [tiles, 2] (:func:`attention.triton_kernels.prefill.prefill_tile_index`).
    """

    query_lens: tuple[int, ...]
    key_lens: tuple[int, ...]
    block_m: int
    q_start: torch.Tensor
    k_start: torch.Tensor
    tile_index: torch.Tensor


def stage_mla_prefill_index(
    query_lens: Sequence[int], key_lens: Sequence[int], block_m: int, device: torch.device
) -> MLAPrefillIndex:
    """The offsets and tile index of rows of ``query_lens`` new tokens over ``key_lens`` keys
    at tiles of ``block_m``, in one non-blocking copy (from pinned memory on CUDA: a copy from
    pageable memory would wait for the stream). Raises InvalidArgumentError for lengths that
    are not ``0 <= query_lens[b] <= key_lens[b]``."""
    q_lens, k_lens = tuple(query_lens), tuple(key_lens)
    _check_lengths(q_lens, k_lens, sum(q_lens), sum(k_lens))
    tiles = prefill_tile_index(list(k_lens), list(q_lens), block_m)
    # Query starts, key starts and the tile index in one staged array, each part starting on
    # 16 bytes: Triton compiles a kernel per alignment of its pointers, and the row count
    # would otherwise pick one of four while serving.
    rows = len(q_lens)
    cut = -(-(rows + 1) // 4) * 4
    starts = [0] * (2 * cut)
    for b, (q, k) in enumerate(zip(q_lens, k_lens, strict=True)):
        starts[b + 1] = starts[b] + q
        starts[cut + b + 1] = starts[cut + b] + k
    staged = DirectStaging(device).stage("mla_prefill_index", array("i", starts + [x for pair in tiles for x in pair]))
    tile_index = staged[2 * cut :].view(-1, 2)
    return MLAPrefillIndex(q_lens, k_lens, block_m, staged[: rows + 1], staged[cut : cut + rows + 1], tile_index)


def mla_prefill_block_m(
    query: torch.Tensor,
    kv: torch.Tensor,
    key_pe: torch.Tensor,
    qk_nope_head_dim: int,
    config: MLAPrefillConfig | None = None,
    hopper: bool = True,
) -> int:
    """The tile height :func:`mla_prefill` runs these tensors at (what its ``index`` must be
    staged with): the Gluon kernel's on an sm_90 GPU where it applies, else the config's."""
    if _runs_on_hopper(query, kv, key_pe, qk_nope_head_dim, config, hopper):
        return MLA_HOPPER_BLOCK_M
    return (config or default_mla_prefill_config(query.dtype)).block_m


def _runs_on_hopper(
    query: torch.Tensor,
    kv: torch.Tensor,
    key_pe: torch.Tensor,
    nope: int,
    config: MLAPrefillConfig | None,
    hopper: bool,
) -> bool:
    """Whether :func:`mla_prefill` takes the Gluon kernel for these tensors."""
    return hopper and config is None and mla_hopper_applies(query, kv, key_pe, nope)


def _check_lengths(query_lens: Sequence[int], key_lens: Sequence[int], tokens: int, keys: int) -> None:
    if len(query_lens) != len(key_lens):
        raise InvalidArgumentError(
            f"query_lens, key_lens: {len(query_lens)} and {len(key_lens)} rows; give one length per row in each"
        )
    for b, (q, k) in enumerate(zip(query_lens, key_lens, strict=True)):
        if not 0 <= q <= k:
            raise InvalidArgumentError(
                f"query_lens[{b}], key_lens[{b}]: {q} new tokens over {k} keys; a row's keys include its new tokens"
            )
    if sum(query_lens) != tokens or sum(key_lens) != keys:
        raise InvalidArgumentError(
            f"query_lens, key_lens: sum to {sum(query_lens)} and {sum(key_lens)}, but query has {tokens} tokens "
            f"and kv {keys}"
        )


def mla_prefill(
    query: torch.Tensor,
    kv: torch.Tensor,
    key_pe: torch.Tensor,
    query_lens: Sequence[int],
    key_lens: Sequence[int],
    *,
    qk_nope_head_dim: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: MLAPrefillConfig | None = None,
    hopper: bool = True,
    index: MLAPrefillIndex | None = None,
) -> torch.Tensor:
    """Causal varlen attention of decompressed MLA heads.

    query:      [T, H, n + e]: per new token and head, ``q_nope`` then the rotated ``q_pe``;
                rows' tokens one after another (``query_lens``).
    kv:         [Tk, H, n + v]: per key and head, ``k_nope`` then the value (the output of
                ``kv_b_proj`` on the keys' latents, viewed per head); rows' keys one after
                another (``key_lens``), each row's cached keys first, then its new ones.
    key_pe:     [Tk, e] (any row stride, channels contiguous): the rotated shared key, e.g.
                ``latents[:, kv_lora_rank:]``.
    query_lens, key_lens: host lengths per row, ``0 <= query_lens[b] <= key_lens[b]``.
    scale:      the softmax scale, ``(n + e) ** -0.5``.
    out:        [T, H, v] of the query's dtype to write (default: a new tensor).
    config:     the Triton kernel's launch (default :func:`default_mla_prefill_config`).
    hopper:     without a ``config``, run DeepSeek-shaped heads on an sm_90 GPU on the Gluon
                kernel (:mod:`.mla_prefill_hopper`, :func:`~.mla_prefill_hopper.mla_hopper_applies`);
                False keeps the Triton kernel.
    index:      the rows' offsets and tile index, staged once for the step's layers
                (:func:`stage_mla_prefill_index` over the same lengths at
                :func:`mla_prefill_block_m`'s tile height); default: staged here, per call.
    Returns ``out``. Raises InvalidArgumentError for tensors of the wrong shape, dtype or
    device, widths the kernel does not take (``n`` a power of two >= 16), lengths that do not
    add up, or an ``index`` made for other lengths, tile height or device. Eager only: the
    row offsets and tile index come from the host lengths.
    """
    if query.dim() != 3 or kv.dim() != 3 or key_pe.dim() != 2:
        raise InvalidArgumentError(
            f"query, kv, key_pe: expected [T, H, n + e], [Tk, H, n + v] and [Tk, e], got {list(query.shape)}, "
            f"{list(kv.shape)} and {list(key_pe.shape)}"
        )
    tokens, heads, qk_dim = query.shape
    keys, kv_heads, kv_dim = kv.shape
    nope, rope = qk_nope_head_dim, qk_dim - qk_nope_head_dim
    value_dim = kv_dim - nope
    if nope < 16 or nope & (nope - 1) or rope <= 0 or value_dim <= 0:
        raise InvalidArgumentError(
            f"qk_nope_head_dim: {nope} with a query of {qk_dim} and kv of {kv_dim} channels; it must be a power "
            "of two >= 16, below both"
        )
    if kv_heads != heads or key_pe.shape != (keys, rope):
        raise InvalidArgumentError(
            f"kv, key_pe: expected [{keys}, {heads}, {kv_dim}] and [{keys}, {rope}], got {list(kv.shape)} and "
            f"{list(key_pe.shape)}"
        )
    for name, t in (("kv", kv), ("key_pe", key_pe)):
        if t.dtype != query.dtype or t.device != query.device:
            raise InvalidArgumentError(f"{name}: {t.dtype} on {t.device}, but query is {query.dtype} on {query.device}")
    if query.stride(-1) != 1 or kv.stride(-1) != 1 or key_pe.stride(-1) != 1:
        raise InvalidArgumentError("query, kv, key_pe: the channels must be contiguous")
    _check_lengths(query_lens, key_lens, tokens, keys)
    if out is None:
        out = torch.empty(tokens, heads, value_dim, dtype=query.dtype, device=query.device)
    elif out.shape != (tokens, heads, value_dim) or out.dtype != query.dtype or out.stride(-1) != 1:
        raise InvalidArgumentError(
            f"out: expected [{tokens}, {heads}, {value_dim}] {query.dtype} with contiguous channels, got "
            f"{list(out.shape)} {out.dtype}"
        )
    cfg = config or default_mla_prefill_config(query.dtype)
    on_hopper = _runs_on_hopper(query, kv, key_pe, nope, config, hopper)
    block_m = MLA_HOPPER_BLOCK_M if on_hopper else cfg.block_m
    if index is None:
        index = stage_mla_prefill_index(query_lens, key_lens, block_m, query.device)
    elif (
        index.block_m != block_m
        or index.query_lens != tuple(query_lens)
        or index.key_lens != tuple(key_lens)
        or index.tile_index.device != query.device
    ):
        raise InvalidArgumentError(
            f"index: staged for {len(index.query_lens)} rows at tiles of {index.block_m} on "
            f"{index.tile_index.device}; this call has {len(query_lens)} rows at tiles of {block_m} on {query.device}; "
            "stage it with stage_mla_prefill_index over these lengths at mla_prefill_block_m's height"
        )
    tiles = index.tile_index.shape[0]
    if not tiles or not heads:
        return out
    q_start, k_start, tile_index = index.q_start, index.k_start, index.tile_index
    if on_hopper:
        return mla_prefill_hopper(
            query, kv, key_pe, q_start, k_start, tile_index, nope=nope, scale=scale, out=out,
            programs=_sm_count(query.device),
        )  # fmt: skip
    upcast = upcast_for(query.dtype)
    _mla_prefill_kernel[(heads, tiles)](
        query, kv, key_pe, out, q_start, k_start, tile_index, scale * _LOG2E,
        query.stride(0), query.stride(1), kv.stride(0), kv.stride(1), key_pe.stride(0), out.stride(0), out.stride(1),
        N=nope, E=rope, V=value_dim, BLOCK_E=next_power_of_2(max(rope, 16)),
        BLOCK_V=next_power_of_2(max(value_dim, 16)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, UPCAST=upcast,
        DOT_PRECISION=dot_precision_for(query.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
