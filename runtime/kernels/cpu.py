"""The CPU as /proc/cpuinfo describes its first processor (vendor, family, model name, feature
flags), read once per process; empty where there is no such file. The float32 library's choice
(``gemm``), the native token limits (``widths``) and the planner's box key read it here."""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["CpuInfo", "amd_full_512", "info", "splits_512"]


@dataclass(frozen=True)
class CpuInfo:
    vendor: str = ""
    family: int = 0
    model_name: str = ""
    flags: frozenset[str] = frozenset()


@functools.lru_cache(maxsize=None)
def info(path: str = "/proc/cpuinfo") -> CpuInfo:
    """The first processor's block of ``path``."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break                    # the end of the first processor's block
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return CpuInfo()
    try:
        family = int(fields.get("cpu family", "0"))
    except ValueError:
        family = 0
    return CpuInfo(fields.get("vendor_id", ""), family, fields.get("model name", ""),
                   frozenset(fields.get("flags", "").split()))


def splits_512(cpu: CpuInfo | None = None) -> bool:
    """Whether the CPU executes a 512-bit vector operation as two 256-bit halves: an AMD CPU
    before Zen 5 (family 0x19, whose only AVX-512 parts are Zen 4). A stable property of the
    box, so what depends on it does not change from run to run."""
    cpu = info() if cpu is None else cpu
    return cpu.vendor == "AuthenticAMD" and 0 < cpu.family < 0x1A


def amd_full_512(cpu: CpuInfo | None = None) -> bool:
    """Whether the CPU is an AMD one with full-width 512-bit units (Zen 5, family 0x1A, and
    later): its token limits were measured apart from an Intel CPU's (``widths``)."""
    cpu = info() if cpu is None else cpu
    return cpu.vendor == "AuthenticAMD" and cpu.family >= 0x1A
