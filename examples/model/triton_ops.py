"""Triton kernels of :mod:`examples.model.ops` (same numeric contract, one kernel each).

One program per token row for the norms (a row of the hidden size fits in registers), one
per (row, chunk of the MLP width) for SiLU x up. Loads are upcast to float32 at once (bf16
under Triton's CPU interpreter is raw 16-bit integers), and every value that the torch form
rounds to the model's dtype is rounded here at the same point, so both give the same bits up
to the order of the mean's summation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton_kernels.paging import kernels_interpreted

__all__ = ["add_rms_norm", "rms_norm", "silu_mul"]

#: MLP channels one SiLU x up program handles.
_SILU_BLOCK = 1024


@triton.jit
def _round(x, dtype, ROUND_BF16: tl.constexpr):  # type: ignore[no-untyped-def]
    """fp32 ``x`` as ``dtype``, rounded to nearest even. ROUND_BF16: Triton's CPU interpreter
    truncates fp32 to bf16, so round the bits first (with integer ops) and let the cast drop
    zeros; the GPU's conversion rounds correctly and skips this."""
    if ROUND_BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    dim,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Row t: s = x (+ residual, rounded to the dtype and stored to sum_ptr when ADD), then
    out = weight * (s / rms(s)) with the normalised value rounded before the product."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < dim
    dtype = out_ptr.dtype.element_ty
    s = tl.load(x_ptr + t * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(residual_ptr + t * stride_r + i, mask=mask, other=0.0).to(tl.float32)
        total = _round(s + r, dtype, ROUND_BF16)
        tl.store(sum_ptr + t * stride_s + i, total, mask=mask)
        s = total.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / dim + eps)
    normed = _round(s * inv, dtype, ROUND_BF16).to(tl.float32)
    w = tl.load(weight_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + i, _round(normed * w, dtype, ROUND_BF16), mask=mask)


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]
    gate_up_ptr, out_ptr, width, stride_g, stride_o, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """Row t, channels [c * BLOCK, (c + 1) * BLOCK): out = silu(gate).to(dtype) * up."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + t * stride_g + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_g + width + i, mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype, ROUND_BF16).to(tl.float32)
    tl.store(out_ptr + t * stride_o + i, _round(silu * up, dtype, ROUND_BF16), mask=mask)


def _round_bf16(dtype: torch.dtype) -> bool:
    return kernels_interpreted() and dtype == torch.bfloat16


def _norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(dim)
        other = residual if residual is not None else x
        if other.stride(-1) != 1:
            other = other.contiguous()
        _rms_norm_kernel[(rows,)](
            x,
            other,
            weight,
            out,
            total if total is not None else out,
            dim,
            float(eps),
            x.stride(0),
            other.stride(0),
            out.stride(0),
            out.stride(0),
            ADD=residual is not None,
            BLOCK=block,
            ROUND_BF16=_round_bf16(x.dtype),
            num_warps=min(16, max(1, block // 256)),
        )
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, dim], weight: [dim] -> [T, dim] (see :mod:`examples.model.ops`)."""
    out, _ = _norm_launch(x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, dim] -> (rms_norm(x + residual), x + residual)."""
    out, total = _norm_launch(x, residual, weight, eps)
    assert total is not None, "ADD launches write the sum"
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * width] -> [T, width] (see :mod:`examples.model.ops`)."""
    rows, double = gate_up.shape
    width = double // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width, _SILU_BLOCK))](
            gate_up,
            out,
            width,
            gate_up.stride(0),
            out.stride(0),
            BLOCK=_SILU_BLOCK,
            ROUND_BF16=_round_bf16(gate_up.dtype),
            num_warps=4,
        )
    return out
