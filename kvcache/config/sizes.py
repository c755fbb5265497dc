"""Byte sizes written the way people write them: ``40GiB``, ``512 MiB``, ``1.5GB``.

One pattern, :data:`SIZE_PATTERN`, says what a size may look like; the parser and the JSON
schema both use it, so an editor accepts exactly what the loader accepts. Units are
case-insensitive (``4gib`` is ``4GiB``), digits are ASCII only, and the number of digits is
bounded, so a hostile string can neither overflow a float nor take long to convert.
"""

from __future__ import annotations

import re

from attention.errors import quote

__all__ = ["MAX_BYTES", "SIZE_PATTERN", "format_bytes", "parse_bytes"]

#: The largest size a config or the CLI may give: 1 PiB, far beyond any device or host.
MAX_BYTES = 2**50

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB, in any case"

#: A size: 1 to 16 ASCII digits, an optional fraction of up to 9 digits, optional spaces, a
#: unit in any case. Written with explicit character classes (no inline flags), so it means
#: the same in Python's ``re`` and in a JSON-schema (ECMA-262) validator.
SIZE_PATTERN = r"^([0-9]{1,16})(\.([0-9]{1,9}))? *(([kKmMgGtTpP][iI]?)?[bB])$"
_SIZE = re.compile(SIZE_PATTERN, re.ASCII)


def parse_bytes(text: str, maximum: int = MAX_BYTES) -> int:
    """Parse ``"40GiB"`` into 42949672960 (a fraction of a byte is dropped).

    Raises ValueError naming the accepted form and units, or the maximum (1 PiB by default).
    """
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"{quote(text)} is not a size; write a number and a unit, e.g. 40GiB or 512MiB (units {_UNIT_NAMES})"
        )
    whole, _, fraction, unit = match.group(1, 2, 3, 4)
    scale = _UNITS[unit.lower()]
    # Exact integer arithmetic: float("1.1") * 10**9 is not 1100000000.
    num_bytes = int(whole) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)
    if num_bytes > maximum:
        raise ValueError(f"{quote(text)} is more than {format_bytes(maximum)}; write a smaller size")
    return num_bytes


def format_bytes(num_bytes: float) -> str:
    """Format with binary units: 42949672960 -> ``"40.00 GiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} PiB"
