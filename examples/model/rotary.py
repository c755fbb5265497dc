"""Rotary position embedding: frequencies (with Llama-3 and linear scaling), cos/sin tables,
and the rotation (the rotate-half convention of transformers' Llama)."""

from __future__ import annotations

import math

import torch

from examples.model.shape import RopeScaling

__all__ = ["apply_rotary", "rope_inv_freq", "rotary_cos_sin"]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> torch.Tensor:
    """float32 [head_dim / 2]: frequency ``i`` is ``theta ** (-2i / head_dim)``, then scaled.

    Computed with device ops only (no host copy), so it can run inside a CUDA graph capture.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths past the low-frequency edge are stretched by `factor`, those
    # under the high-frequency edge kept, the band between interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old_len / scaling.high_freq_factor) * ~(wavelen > old_len / scaling.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions`` (int [T]): each float32 [T, 1, head_dim].

    The table repeats the half-width angles twice, which pairs channel ``j`` with
    ``j + head_dim/2`` (the rotate-half convention).
    """
    angles = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
    table = torch.cat((angles, angles), dim=-1)[:, None, :]  # [T, 1, D]
    return table.cos(), table.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, heads, D] by the angles in cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
