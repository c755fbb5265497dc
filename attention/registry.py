"""Backends by name, imported lazily: importing :mod:`attention` never imports triton or
flash_attn. Everything here derives from the backend table (:data:`attention.capabilities.BACKENDS`).
Asking for a backend whose library is missing raises :class:`BackendUnavailableError` naming the
``pip install`` to run.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attention.capabilities import BACKENDS, BackendInfo
from attention.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedSettingError

if TYPE_CHECKING:
    from attention.base import AttentionBackend
    from attention.spec import AttentionSpec

__all__ = ["BackendChoice", "available_backends", "choose_backend", "get_backend", "library_installed"]


def library_installed(info: BackendInfo) -> bool:
    """Whether ``info``'s kernel library is importable (without importing it)."""
    return info.library is None or importlib.util.find_spec(info.library) is not None


def available_backends() -> list[str]:
    """Names whose kernel library is importable (without importing it), in table order."""
    return [name for name, info in BACKENDS.items() if library_installed(info)]


def get_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    """A backend instance for one attention shape.

    Raises InvalidArgumentError for an unknown name (``auto`` included: resolve it with
    :func:`choose_backend`), BackendUnavailableError naming the pip extra when the backend's
    library is missing, and UnsupportedSettingError when the backend refuses ``spec``.
    """
    if name not in BACKENDS:
        hint = "; resolve 'auto' with choose_backend()" if name == "auto" else ""
        raise InvalidArgumentError(
            f"name: attention backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}{hint}"
        )
    info = BACKENDS[name]
    if not library_installed(info):
        raise BackendUnavailableError(
            f"attention backend {name!r} needs the {info.library} package, which is not "
            f"installed; run: pip install -e '.[{info.pip_extra}]' in the project checkout"
        )
    cls = getattr(importlib.import_module(info.module), info.class_name)
    backend: AttentionBackend = cls(spec)
    return backend


@dataclass(frozen=True)
class BackendChoice:
    """The backend ``auto`` (or an explicit name) resolved to, and why."""

    backend: AttentionBackend
    reason: str


def choose_backend(name: str, spec: AttentionSpec, *, device_type: str, block_size: int) -> BackendChoice:
    """Resolve ``auto`` (or check an explicit name) for a device type ("cpu"/"cuda"), a block
    size and an attention shape.

    ``auto`` takes the installed backend of lowest ``auto_priority`` whose declared
    capabilities accept the setting, and says why (naming the ones it skipped). An explicit
    name is checked against its capabilities; raises UnsupportedSettingError listing each
    refusal, with the fix.
    """
    if name != "auto":
        info = BACKENDS.get(name)
        if info is not None:
            refused = _problems(info, spec, device_type, block_size)
            if refused:
                raise UnsupportedSettingError(f"backend {name} refuses this setting: " + "; ".join(refused))
        return BackendChoice(get_backend(name, spec), f"{name} (set in the config)")
    skipped = []
    for info in sorted(BACKENDS.values(), key=lambda b: b.auto_priority):
        refused = _problems(info, spec, device_type, block_size)
        if refused:
            skipped.append(f"{info.name}: {refused[0]}")
        elif not library_installed(info):
            skipped.append(f"{info.name}: not installed")
        else:
            why = f"{info.name} (auto: first supported on {device_type}"
            why += f"; skipped {'; '.join(skipped)})" if skipped else ")"
            return BackendChoice(get_backend(info.name, spec), why)
    raise UnsupportedSettingError("no attention backend accepts this setting: " + "; ".join(skipped))


def _problems(info: BackendInfo, spec: AttentionSpec, device_type: str, block_size: int) -> list[str]:
    return [
        f"{p.parameter} {p.value}: {p.reason}; {p.fix}"
        for p in info.spec_problems(spec, block_size=block_size, device_type=device_type)
    ]
