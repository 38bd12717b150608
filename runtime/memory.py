"""How much memory this process may really use, and a RAM tier that fits in it.

The limit is the smallest of physical RAM and the memory cgroup's cap (v2 ``memory.max`` or
v1 ``memory.limit_in_bytes``), because a container or a ``systemd-run -p MemoryMax=`` box
counts the page cache too: a RAM tier sized from physical RAM inside a small cgroup pushes the
memory-mapped trunk out, and every token then re-reads it from disk.
"""

from __future__ import annotations

import logging
import os

__all__ = ["physical_memory", "cgroup_limit", "memory_limit", "default_ram_tier",
           "RUNTIME_OVERHEAD", "KV_GROWTH_PEAK", "kv_reserve", "check_budget",
           "resident_trunk_bytes"]

log = logging.getLogger(__name__)

#: Python, torch, the native kernels, staging buffers and allocator slack beside the RAM tier,
#: the trunk and the KV cache: the CPU runtime's peak resident memory beyond those three, with
#: a margin.
RUNTIME_OVERHEAD = 384 << 20
#: The KV cache grows by doubling up to the context limit; while it grows the old and the new
#: buffers coexist, so its peak is 1.5x its size at the limit.
KV_GROWTH_PEAK = 1.5
_UNLIMITED = 1 << 60


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_limit() -> int | None:
    """This process's memory cgroup cap in bytes, or None when there is none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and ctrls == "":                      # cgroup v2
            v = _read_int(f"/sys/fs/cgroup{path}/memory.max")
        elif "memory" in ctrls.split(","):                  # cgroup v1
            v = _read_int(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        else:
            continue
        if v is not None and v < _UNLIMITED // 2:
            limits.append(v)
    return min(limits) if limits else None


def memory_limit() -> int:
    cg = cgroup_limit()
    phys = physical_memory()
    return min(phys, cg) if cg else phys


def kv_reserve(kv_bytes: int) -> int:
    """Host memory to keep for a KV cache of ``kv_bytes`` at the context limit (its growth peak)."""
    return int(kv_bytes * KV_GROWTH_PEAK)


def default_ram_tier(trunk_bytes: int, limit: int | None = None, cap: int = 4 << 30,
                     kv_bytes: int = 0) -> int:
    """A RAM tier that leaves room for the trunk, the KV cache at the context limit
    (``kv_bytes``, when it lives in host memory), the runtime and the OS: at most ``cap``, at
    most a quarter of physical RAM, and at most what the memory limit leaves after them (never
    below 64 MiB: the caller says when that is too small)."""
    limit = memory_limit() if limit is None else limit
    room = limit - trunk_bytes - RUNTIME_OVERHEAD - kv_reserve(kv_bytes)
    return max(64 << 20, min(cap, physical_memory() // 4, room))


def check_budget(ram_bytes: int, trunk_bytes: int, limit: int | None = None,
                 kv_bytes: int = 0) -> str | None:
    """A warning when the RAM tier, the trunk, the KV cache and the runtime exceed the memory
    limit."""
    limit = memory_limit() if limit is None else limit
    rest = trunk_bytes + RUNTIME_OVERHEAD + kv_reserve(kv_bytes)
    if ram_bytes + rest <= limit:
        return None
    fit = max(0, limit - rest)
    kv = f" + KV cache {kv_reserve(kv_bytes) >> 20} MiB" if kv_bytes else ""
    return (f"RAM tier {ram_bytes >> 20} MiB + trunk {trunk_bytes >> 20} MiB{kv} + runtime "
            f"{RUNTIME_OVERHEAD >> 20} MiB exceed this process's memory limit of {limit >> 20} MiB: "
            f"the trunk would be evicted and re-read from disk every token (or the process "
            f"killed); use --ram {fit >> 20}M or less, or a smaller --ctx")


def resident_trunk_bytes(store) -> int:
    """Trunk bytes the forward pass keeps touching on the CPU: all of ``trunk.bin`` except the
    token embedding when the output head has its own matrix. The trunk is mapped from the file
    and the embedding is read a row per token, so its pages are not resident (150k-token
    vocabularies make that 0.6-1.2 GB); a tied embedding is the output head, read every token."""
    records = store.trunk_tensors()
    total = int(store.summary.get("trunk_file_bytes", 0))
    emb = records.get("token_embd.weight")
    if emb is not None and "output.weight" in records:
        total -= int(emb.nbytes)
    return max(0, total)
