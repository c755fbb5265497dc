"""Rotary frequencies, with Llama-3 and linear scaling. The cos/sin table built from them and
the rotation itself are :mod:`attention.rotary` (the attention boundary applies them)."""

from __future__ import annotations

import math

import torch

from .shape import RopeScaling

__all__ = ["rope_inv_freq"]


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
