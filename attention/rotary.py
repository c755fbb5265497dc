"""Rotary position embedding as the attention boundary applies it: a precomputed cos/sin table
and the rotation of the rotate-half (GPT-NeoX, Llama) convention.

The table is built once per model from its inverse frequencies (any scaling, Llama-3 or
linear, is already folded into them), so a step only gathers rows of it at the step's
positions: ``table[p] = [cos(p * f_0), ..., cos(p * f_{D/2-1}), sin(p * f_0), ..., sin(p *
f_{D/2-1})]``, float32. Channel ``j < D/2`` of a head is paired with channel ``j + D/2``:

    out[j]       = x[j] * cos_j - x[j + D/2] * sin_j
    out[j + D/2] = x[j + D/2] * cos_j + x[j] * sin_j

the same values as transformers' ``apply_rotary_pos_emb`` (which writes it as ``x * cos +
rotate_half(x) * sin``), computed here in float32 and rounded once to the input's dtype.
:func:`rotate` is the plain-torch form every backend's fused kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.checks import check_tensor, require_int
from attention.errors import InvalidArgumentError

__all__ = ["RotaryTable", "rotate"]

#: Most positions a table may hold (a bound for argument checks: 2**24 x 128 x 4 B = 8 GiB).
MAX_POSITIONS = 1 << 24


@dataclass(frozen=True)
class RotaryTable:
    """cos_sin: float32 [max_positions, head_dim], contiguous; row ``p`` holds the cosines then
    the sines of position ``p``'s angles (see the module docstring)."""

    cos_sin: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor("cos_sin", self.cos_sin, shape=(None, None), dtype=torch.float32)
        rows, width = self.cos_sin.shape
        if rows < 1 or width < 2 or width % 2 or not self.cos_sin.is_contiguous():
            raise InvalidArgumentError(
                f"cos_sin: expected a contiguous float32 [max_positions >= 1, even head_dim] table, "
                f"got shape {list(self.cos_sin.shape)}; build it with RotaryTable.build"
            )

    @staticmethod
    def build(inv_freq: torch.Tensor, max_positions: int, device: torch.device | str | None = None) -> RotaryTable:
        """The table for positions ``0 .. max_positions - 1``.

        inv_freq: float32 [head_dim / 2], the rotation speed of each channel pair (scaled).
        The angles are ``float32(p) * inv_freq`` (as transformers computes them), then cos and sin.
        """
        max_positions = require_int("max_positions", max_positions, minimum=1, maximum=MAX_POSITIONS)
        check_tensor("inv_freq", inv_freq, shape=(None,), dtype=torch.float32)
        device = inv_freq.device if device is None else torch.device(device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        angles = positions[:, None] * inv_freq.to(device)[None, :]
        return RotaryTable(torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous())

    @property
    def head_dim(self) -> int:
        return int(self.cos_sin.shape[1])

    @property
    def max_positions(self) -> int:
        return int(self.cos_sin.shape[0])

    @property
    def device(self) -> torch.device:
        return self.cos_sin.device


def rotate(x: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """``x`` rotated at ``positions``: x [T, heads, head_dim] (any float dtype), positions
    int64 [T] -> a new contiguous tensor like ``x``. Positions outside the table are clamped
    into it (callers check lengths on the host; a device value is never trusted to index)."""
    half = table.head_dim // 2
    rows = table.cos_sin[positions.clamp(0, table.max_positions - 1)]  # [T, D]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    x32 = x.float()
    lo, hi = x32[..., :half], x32[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1).to(x.dtype)
