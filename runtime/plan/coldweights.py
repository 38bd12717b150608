"""The weights a kernel probe streams through (``plan.native``): enough copies, past this CPU's
last-level cache, that each timed call reads its weights from memory as a decode step does,
kept in one buffer a process so its pages are touched once."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["CAP", "llc_bytes", "cold_bytes", "rotation", "release_pool"]

#: bytes of one timed matrix at most (a larger one is cut to its first rows), and of the weights
#: a timing streams through at least: past a desktop or server last-level cache, as a decode's
#: weights come from memory (timed inside the cache, the probe priced a full-depth decode well
#: faster than it ran, bench/README.md); ``cold_bytes`` more where the cache is larger
CAP = 96 << 20
#: the most bytes a timing streams through (a CPU whose last-level cache is larger: its own)
_COLD_MAX = 1 << 30
#: one buffer a process for the weights a timing streams through (``rotation``)
_POOL: list[Any] = []


def llc_bytes(cpu: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """This CPU's last-level cache in bytes, as Linux describes it (the largest cache of the
    highest level under ``cpu``); 0 where it does not."""
    best = (0, 0)
    try:
        for d in os.listdir(cpu):
            if not d.startswith("index"):
                continue
            with open(os.path.join(cpu, d, "level")) as f, open(os.path.join(cpu, d, "size")) as g:
                level, size = int(f.read()), g.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            best = max(best, (level, int(size.rstrip("KMG")) * mult))
    except (OSError, ValueError):
        return 0
    return best[1]


def cold_bytes() -> int:
    """Bytes of weights a timing streams through so that each call reads them from memory:
    twice this CPU's last-level cache (a server's can hold hundreds of MiB, where ``CAP`` of
    weights stayed in it and the probe priced a decode's output head faster than it ran,
    bench/README.md), at least ``CAP``, at most ``_COLD_MAX``."""
    return int(min(_COLD_MAX, max(CAP, 2 * llc_bytes())))


def release_pool() -> None:
    """Frees ``rotation``'s buffer (the probes that stream weights are done)."""
    _POOL.clear()


def rotation(groups: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """``groups`` (each a matrix's bytes, or an expert's parts) repeated in turn to about
    ``cold_bytes()``, as views of one buffer allocated once a process (its pages touched once,
    not per type: a fresh page's first touch is slow on a virtual machine), each a copy of its
    group, so timings that take the next one each call read their weights from memory."""
    import torch

    sizes = [(t.numel() + 63) // 64 * 64 for t in groups[0]]      # 64-byte aligned views
    per = sum(sizes)
    n = max(len(groups), cold_bytes() // max(1, per))
    if not _POOL or _POOL[0].numel() < n * per:   # one size for every call: no second buffer
        _POOL[:] = []
        _POOL.append(torch.empty(max(n * per, cold_bytes() + CAP), dtype=torch.uint8))
    buf, out, at = _POOL[0], [], 0
    for i in range(n):
        views = []
        for t, size in zip(groups[i % len(groups)], sizes):
            v = buf[at: at + t.numel()]
            v.copy_(t.reshape(-1))
            views.append(v)
            at += size
        out.append(tuple(views))
    return out
