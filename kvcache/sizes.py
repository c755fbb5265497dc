"""Byte sizes written the way people write them: ``40GiB``, ``512 MiB``, ``1.5GB``."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


def parse_bytes(text: str) -> int:
    """Parse ``"40GiB"`` into 42949672960. Raises ValueError naming the accepted units."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size; write a number and a unit, e.g. 40GiB or 512MiB "
            f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num_bytes: float) -> str:
    """Format with binary units: 42949672960 -> ``"40.00 GiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
