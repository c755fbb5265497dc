"""Copies of row-strided tensors between host and device on the copy engines alone.

A cache block is every layer's K and V of its tokens: in the device cache, ``2 * num_layers``
rows of ``block_size * kv_heads * head_dim`` elements, one row every ``num_blocks`` rows; in a
host pool, the same rows back to back. ``torch.Tensor.copy_`` moves such a strided tensor
between host and device through a contiguous staging copy, a kernel that needs free SMs: while
a step's kernels hold every SM, the copy waits behind them. ``cudaMemcpy2DAsync`` moves the rows
directly (one DMA descriptor per block), so a block copy runs beside the step, at PCIe speed.

:func:`copy_rows` calls it through the CUDA runtime torch has loaded (found in the process's
memory map, so it shares torch's device and stream state). :func:`pitched_copies_available`
says whether that runtime was found; without it, callers keep a staged path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from attention.errors import InvalidArgumentError

__all__ = ["copy_rows", "pitched_copies_available"]

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (unified addressing)


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded, or None (no CUDA, or a runtime linked statically)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        maps = []
    paths = sorted({line.split()[-1] for line in maps if "libcudart" in line.rsplit("/", 1)[-1]})
    for name in [*paths, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
        fn.argtypes += [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        return lib
    return None


def pitched_copies_available() -> bool:
    """Whether :func:`copy_rows` can run here (CUDA, and torch's runtime library found)."""
    return _cudart() is not None


def _row_pitch(name: str, t: torch.Tensor) -> int:
    """The byte distance between ``t``'s rows (dim 0), each of which must be contiguous."""
    if t.dim() < 2 or not t[0].is_contiguous() or t.stride(0) < t[0].numel():
        raise InvalidArgumentError(
            f"{name}: shape {tuple(t.shape)} strides {t.stride()}: rows (dim 0) must each be contiguous and "
            "must not overlap; pass a view such as storage[:, :, block].flatten(0, 1)"
        )
    return t.stride(0) * t.element_size()


def copy_rows(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Queue ``dst.copy_(src)`` on ``stream`` as one ``cudaMemcpy2DAsync``.

    dst, src: ``[rows, ...]`` of one shape and dtype, one on the device and one in pinned host
              memory (or both on the device); each row contiguous, rows any distance apart.

    Nothing keeps the tensors alive or orders other streams: the caller records an event after
    the copy, makes readers wait on it, and keeps both tensors until it has completed. Raises
    InvalidArgumentError for mismatched or non-row-strided tensors, RuntimeError when the
    runtime is missing or refuses the copy.
    """
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise InvalidArgumentError(
            f"dst, src: {tuple(dst.shape)} {dst.dtype} and {tuple(src.shape)} {src.dtype}: "
            "a copy needs one shape and one dtype"
        )
    dst_pitch, src_pitch = _row_pitch("dst", dst), _row_pitch("src", src)
    lib = _cudart()
    if lib is None:
        raise RuntimeError("copy_rows: the CUDA runtime was not found; check pitched_copies_available() first")
    width = src[0].numel() * src.element_size()
    status = lib.cudaMemcpy2DAsync(
        dst.data_ptr(), dst_pitch, src.data_ptr(), src_pitch, width, src.shape[0], _MEMCPY_DEFAULT, stream.cuda_stream
    )
    if status != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: {lib.cudaGetErrorString(status).decode()} (error {status})")
