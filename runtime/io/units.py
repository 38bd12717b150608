"""Byte sizes as people write them ("4 MiB", "1.5GB", "4096") and back."""

from __future__ import annotations

import re

from .errors import IOUsageError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, *, what: str = "size") -> int:
    """``"4 MiB"`` -> 4194304. Plain numbers are bytes; k/M/G are powers of 1000, KiB/MiB/GiB of 1024."""
    if isinstance(text, int):
        return text
    m = _RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise IOUsageError(f"{what} {text!r} is not a byte size",
                           fix="write a number with an optional unit, e.g. 4096, '4 MiB', '1.5GB'")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """4194304 -> '4.0MiB' (binary units, as fio prints them)."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"
