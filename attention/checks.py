"""Argument checks shared by both packages: each error names the argument, what was expected
and what was got. The passing path builds no strings (these run on every call)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

from attention.errors import ArgumentTypeError, InvalidArgumentError, quote

if TYPE_CHECKING:
    import torch

__all__ = ["cdiv", "check_tensor", "is_bool_scalar", "require_int", "same_device"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b`` (blocks that hold ``a`` tokens)."""
    return -(-a // b)


def require_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``.

    Accepts Python ints and integer scalars that implement ``__index__`` (numpy ints, 0-d
    integer tensors); refuses bools, floats and strings with ArgumentTypeError, and values
    out of range with InvalidArgumentError.
    """
    if type(value) is not int and (isinstance(value, bool) or is_bool_scalar(value)):
        raise ArgumentTypeError(f"{name}: expected an integer, got bool {value!r:.40}")
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentTypeError(f"{name}: expected an integer, got {type(value).__name__} {quote(value)}") from None
    if minimum is not None and result < minimum:
        raise InvalidArgumentError(f"{name}: {result} is below the minimum {minimum}")
    if maximum is not None and result > maximum:
        raise InvalidArgumentError(f"{name}: {result} is above the maximum {maximum}")
    return result


def is_bool_scalar(value: object) -> bool:
    """Whether ``value`` is a bool scalar of torch or numpy (a 0-d bool tensor, ``np.bool_``),
    which ``operator.index`` and ``array`` take as 0 or 1 (a Python bool is not one: test it
    with isinstance)."""
    return str(getattr(value, "dtype", "")) in ("torch.bool", "bool")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where ``cuda`` (no index) means the current CUDA device."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    import torch

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

    Raises ArgumentTypeError for a non-tensor, InvalidArgumentError otherwise:
    ``query: expected shape [T, 32, 128] ..., got [...]``.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    got = tensor.shape
    if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InvalidArgumentError(f"{name}: expected shape {want}, got {list(got)}")
    allowed = (dtype,) if isinstance(dtype, torch.dtype) else dtype
    if allowed is not None and tensor.dtype not in allowed:
        raise InvalidArgumentError(f"{name}: expected dtype {' or '.join(str(d) for d in allowed)}, got {tensor.dtype}")
    if device is not None and tensor.device != device and not same_device(tensor.device, device):
        raise InvalidArgumentError(f"{name}: expected a tensor on {device}, got one on {tensor.device}")
    return tensor
