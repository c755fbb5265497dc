"""Backends by name, imported lazily: importing :mod:`attention` never imports triton or
flash_attn. Asking for a backend whose library is missing raises an ImportError that names
the ``pip install`` to run.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from attention.base import AttentionBackend
from attention.capabilities import BACKEND_CAPABILITIES, capabilities_of

__all__ = ["BackendChoice", "available_backends", "choose_backend", "get_backend"]


@dataclass(frozen=True)
class _Entry:
    module: str
    cls: str
    library: str | None  # the importable kernel library it needs


_REGISTRY: dict[str, _Entry] = {
    "reference": _Entry("attention.reference", "ReferenceBackend", None),
    "triton": _Entry("attention.triton_backend", "TritonBackend", "triton"),
    "flash_attn": _Entry("attention.flash_attn_backend", "FlashAttnBackend", "flash_attn"),
}

#: Order in which ``auto`` tries backends on CUDA (fastest first, from
#: benchmarks/results/attention-*.json); on CPU only the reference runs.
AUTO_ORDER_CUDA: tuple[str, ...] = ("triton", "flash_attn", "reference")


def _library_installed(library: str | None) -> bool:
    return library is None or importlib.util.find_spec(library) is not None


def available_backends() -> list[str]:
    """Names whose kernel library is importable (without importing it)."""
    return [name for name, e in _REGISTRY.items() if _library_installed(e.library)]


def get_backend(name: str) -> AttentionBackend:
    """A backend instance by name. Raises KeyError for an unknown name and ImportError naming
    the pip extra when the backend's library is missing."""
    if name not in _REGISTRY:
        raise KeyError(f"attention backend {name!r} is unknown; choose one of {', '.join(_REGISTRY)}")
    entry = _REGISTRY[name]
    if not _library_installed(entry.library):
        extra = capabilities_of(name).pip_extra
        raise ImportError(
            f"attention backend {name!r} needs the {entry.library} package, which is not "
            f"installed; run: pip install 'paged-kvcache[{extra}]'"
        )
    cls = getattr(importlib.import_module(entry.module), entry.cls)
    backend: AttentionBackend = cls()
    return backend


@dataclass(frozen=True)
class BackendChoice:
    backend: AttentionBackend
    reason: str


def choose_backend(
    name: str, *, device: torch.device, block_size: int, head_dim: int, dtype: str
) -> BackendChoice:
    """Resolve ``auto`` (or check an explicit name) for a device and cache shape.

    ``auto`` takes the first backend in :data:`AUTO_ORDER_CUDA` that is installed and whose
    declared capabilities accept the setting (on CPU: the reference), and says why.
    """
    if name != "auto":
        return BackendChoice(get_backend(name), f"{name} (set in the config)")
    if device.type != "cuda":
        return BackendChoice(get_backend("reference"), "reference (auto: the only backend for CPU)")
    skipped = []
    for candidate in AUTO_ORDER_CUDA:
        caps = BACKEND_CAPABILITIES[candidate]
        problems = caps.problems(block_size=block_size, head_dim=head_dim, dtype=dtype, device_type="cuda")
        if not _library_installed(_REGISTRY[candidate].library):
            skipped.append(f"{candidate}: not installed")
        elif problems:
            skipped.append(f"{candidate}: {problems[0].reason}")
        else:
            why = f"{candidate} (auto: fastest supported on CUDA"
            why += f"; skipped {'; '.join(skipped)})" if skipped else ")"
            return BackendChoice(get_backend(candidate), why)
    raise AssertionError("the reference backend accepts every valid config")
