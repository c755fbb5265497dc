"""A matrix product for few rows (decode steps): ``x @ weight.T`` streamed at HBM bandwidth.

With at most 128 rows, a linear layer of an 8B model reads its weight once and computes
little: its time is the weight's bytes over the bandwidth the kernel keeps in flight. One
program computes a ``[rows, BLOCK_N]`` tile of the output over one of ``SPLIT_K`` slices of the
inner dimension, so even a layer with few output tiles (4096 columns: 64 tiles of 64) has more
programs than the GPU has SMs. Split slices store float32 partials; the last program of a tile
to finish (an acq_rel counter, reset to 0 by that program) adds them in slice order and
writes the tile, so the result is deterministic: the same bits whatever order the programs
run in, in a CUDA graph or not.

The rows are one tile of ``BLOCK_M`` (16..128); ``weight`` is ``[N, K]`` contiguous (as
``nn.Linear`` stores it) and ``K`` a multiple of ``SPLIT_K * BLOCK_K``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["MAX_ROWS", "SkinnyConfig", "default_skinny_config", "skinny_linear", "skinny_supported"]

#: The most rows one launch takes (one tile of rows).
MAX_ROWS = 128


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters: output columns per program, inner-dimension step, slices of the
    inner dimension (1: no partials), Triton's warps and pipeline stages."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    K_SLICE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program (n tile, k slice): acc = x[:, slice] @ w[tile, slice].T in float32; with
    SPLIT_K > 1 the tile's last program adds the slices' partials in order."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_SLICE + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K_SLICE, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials: [SPLIT_K, BLOCK_M, N] float32.
        tile = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * BLOCK_M * N + tile, acc, mask=out_mask)
        # Every thread's partial stores precede the release (the atomic runs on one thread).
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # slice order: the same sum whoever arrives last
                total += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=out_mask, other=0.0)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def _block_m(rows: int) -> int:
    return max(16, 1 << max(0, rows - 1).bit_length())


@functools.cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def default_skinny_config(rows: int, n: int, k: int, num_sms: int) -> SkinnyConfig | None:
    """The configuration for ``rows x k @ k x n`` on a GPU with ``num_sms`` SMs, or None
    when it does not apply (more than MAX_ROWS rows, or K not a multiple of 128): tiles of 64
    columns (128 when that alone gives two programs per SM), and the inner dimension split in
    the fewest of 1, 2, 4, 8 slices that gives two programs per SM (the most that divides K
    otherwise)."""
    block_k = 128
    if rows > MAX_ROWS or k % block_k:
        return None
    block_n = 128 if n // 128 >= 2 * num_sms else 64
    tiles = -(-n // block_n)
    splits = [s for s in (1, 2, 4, 8) if k % (s * block_k) == 0]
    split = next((s for s in splits if tiles * s >= 2 * num_sms), splits[-1])
    return SkinnyConfig(block_n, block_k, split)


class _Workspace:
    """Partials and counters per (device, N, BLOCK_M, SPLIT_K), allocated once (before any
    CUDA-graph capture: the eager warm-up runs first) and shared by every layer of that shape
    (layers run one after another on one stream)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(
        self, device: torch.device, n: int, block_m: int, config: SkinnyConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, n, block_m, config.split_k, config.block_n)
        found = self._buffers.get(key)
        if found is None:
            parts = torch.empty(config.split_k * block_m * n, dtype=torch.float32, device=device)
            counters = torch.zeros(-(-n // config.block_n), dtype=torch.int32, device=device)
            found = self._buffers[key] = (parts, counters)
        return found


_WORKSPACE = _Workspace()


def skinny_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear` takes this product: CUDA, 16-bit, at most MAX_ROWS rows,
    contiguous rows, a contiguous weight of the same dtype, and a K that splits."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.stride(-1) == 1
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == weight.shape[1]
        and weight.shape[1] % 128 == 0
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x @ weight.T``: x [M, K] (M <= MAX_ROWS), weight [N, K] -> [M, N] in x's dtype
    (float32 accumulation). Call only where :func:`skinny_supported` holds."""
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        config = default_skinny_config(m, n, k, _num_sms(index))
        if config is None:
            raise ValueError(f"skinny_linear: no split of K={k} in steps of 128; use F.linear")
    if k % (config.split_k * config.block_k):
        raise ValueError(f"config: K={k} is not a multiple of split_k * block_k = {config.split_k * config.block_k}")
    block_m = _block_m(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    parts, counters = _WORKSPACE.get(x.device, n, block_m, config)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    _skinny_kernel[grid](
        x,
        weight,
        out,
        parts,
        counters,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        K_SLICE=k // config.split_k,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=config.split_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
