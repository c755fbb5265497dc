"""The model's elementwise work between its matrix products, one kernel each on a GPU:
RMSNorm (optionally adding the residual first) and SiLU(gate) x up.

Each op has one numeric contract, the one transformers' Llama computes in the model's dtype:

- ``rms_norm(x)``: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)`` with ``x32`` the
  float32 copy of ``x`` (the product rounded to the model's dtype);
- ``add_rms_norm(x, residual)``: ``s = x + residual`` rounded to the dtype, then ``rms_norm(s)``;
  returns both (the sum is the next residual);
- ``silu_mul(gate_up)``: ``silu(gate)`` rounded to the dtype, times ``up``, rounded again.

Gemma's variants, as transformers computes them (torch ops everywhere):

- ``offset_rms_norm(x)``: ``(x32 * rsqrt(mean(x32^2) + eps) * (1 + weight32)).to(dtype)``;
- ``gelu_tanh_mul(gate_up)``: ``gelu(gate, approximate="tanh")`` rounded, times ``up``.

On CUDA, with Triton installed, each is one kernel (:mod:`examples.model.triton_ops`): the
float32 copies live in registers, never in memory. Elsewhere they are the torch ops above,
which on CPU give exactly transformers' values.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

__all__ = ["add_rms_norm", "fused_ops_available", "gelu_tanh_mul", "offset_rms_norm", "rms_norm", "silu_mul"]


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_ops_available(device: torch.device) -> bool:
    """Whether the ops run as Triton kernels on ``device`` (CUDA with Triton installed)."""
    return device.type == "cuda" and _triton_installed()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, dim], weight: [dim] (x's dtype) -> [T, dim]."""
    if fused_ops_available(x.device):
        from . import triton_ops

        return triton_ops.rms_norm(x, weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, dim] -> (rms_norm(x + residual), x + residual), both [T, dim]."""
    if fused_ops_available(x.device):
        from . import triton_ops

        return triton_ops.add_rms_norm(x, residual, weight, eps)
    total = x + residual
    return rms_norm(total, weight, eps), total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * width] (gate, then up) -> silu(gate) * up: [T, width]."""
    if fused_ops_available(gate_up.device):
        from . import triton_ops

        return triton_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim] -> [..., dim]: RMSNorm scaled by ``1 + weight``, all in float32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * width] (gate, then up) -> gelu_tanh(gate) * up: [T, width]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
