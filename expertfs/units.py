"""Byte sizes as people write them (``4G``, ``512M``, ``2MiB``) and as we print them."""

from __future__ import annotations

import re

__all__ = ["parse_size", "fmt_bytes"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"4G"`` → 4 GiB in bytes. Units are binary (K = 1024); ``ValueError`` if unreadable."""
    m = _RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 4096, 64K, 512M, 4G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
