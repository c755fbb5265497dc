"""Argument checks shared by every backend: each error says the argument, expected and got."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_tensor", "same_device"]


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where ``cuda`` (no index) means the current CUDA device."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def check_tensor(
    name: str,
    tensor: object,
    *,
    shape: Sequence[int | None],
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check ``tensor`` against an expected shape (None: any size), dtype(s) and device.

    Raises TypeError/ValueError: ``query: expected shape [T, 32, 128] ..., got [...]``.
    Runs on every layer call, so the passing path builds no strings.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    got = tensor.shape
    if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(got)}")
    allowed = (dtype,) if isinstance(dtype, torch.dtype) else dtype
    if allowed is not None and tensor.dtype not in allowed:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in allowed)}, got {tensor.dtype}")
    if device is not None and tensor.device != device and not same_device(tensor.device, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {tensor.device}")
    return tensor
