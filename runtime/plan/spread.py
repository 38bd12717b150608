"""The box's speed checks of the last day and how they widen the cached rates' ends.

``plan`` caches this machine's rates (``boxcache``) and, each time it runs, a short speed
check of the CPU (``native.speed_check``) and of the drive (``storage_probe.storage_check``).
A virtual or shared box moves by more than one probe shows, so every cached figure is widened
to the slowest and fastest of the checks of the last ``SPREAD_WINDOW_S`` against the check made
beside it (bench/README.md).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from .rates import DeviceRates, LinearCost, Range

__all__ = ["SPREAD_WINDOW_S", "SPREAD_CHECKS", "SPREAD_LIMIT", "recent_checks", "spread_of",
           "storage_spread", "spread_range", "with_spread"]

#: the speed checks that count towards the box's spread: this recent, this many at most
SPREAD_WINDOW_S = 24 * 3600
SPREAD_CHECKS = 64
#: and the most they may widen an end by
SPREAD_LIMIT = 2.0


def _in_window(checks: Any) -> list[list[float]]:
    """The kept speed checks ([unix time, GB/s]) of the last ``SPREAD_WINDOW_S``."""
    t = time.time()
    return [[float(c[0]), float(c[1])] for c in (checks if isinstance(checks, list) else [])
            if isinstance(c, list) and len(c) == 2 and t - float(c[0]) <= SPREAD_WINDOW_S]


def _speeds(checks: Any) -> list[float]:
    """The positive figures of the kept checks of the window."""
    return [c[1] for c in _in_window(checks) if c[1] > 0]


def recent_checks(old: Any, now: float) -> list[list[float]]:
    """The kept speed checks still in the window, with ``now`` added."""
    return (_in_window(old) + [[time.time(), float(now)]])[-SPREAD_CHECKS:]


def spread_of(checks: Any, ref: float) -> tuple[float, float]:
    """(slowest, fastest) of the recent checks against ``ref`` (the check the rates were
    measured beside): at most 1 and at least 1, within ``SPREAD_LIMIT``."""
    speeds = _speeds(checks)
    if not speeds or ref <= 0:
        return 1.0, 1.0
    return (max(1 / SPREAD_LIMIT, min(1.0, min(speeds) / ref)),
            min(SPREAD_LIMIT, max(1.0, max(speeds) / ref)))


def storage_spread(rng: Range, checks: Any) -> Range:
    """The drive's cached ``rng`` (GB/s) widened to the slowest and fastest storage check of
    the last day (each a short point at the slow end's depth,
    ``storage_probe.storage_check``): a virtual or shared disk, or one whose cache held what
    was just written, moves by more than one probe shows (bench/README.md)."""
    speeds = _speeds(checks)
    if not speeds:
        return rng
    lo, hi = min(rng.slow, min(speeds)), max(rng.fast, max(speeds))
    if (lo, hi) == (rng.slow, rng.fast):
        return rng
    return Range(lo, hi, rng.source + f" (ends widened to {lo:.2f}-{hi:.2f} GB/s: "
                 f"{len(speeds)} storage checks of the last day)")


def spread_range(x: Range, slow: float, fast: float, seconds: bool = False) -> Range:
    """``x`` with its slow end ``slow`` times as fast and its fast end ``fast`` times (a rate
    times it; ``seconds``: a time over it); the source says so."""
    if slow == fast == 1.0:
        return x
    note = f" (ends widened x{slow:.2f}-x{fast:.2f}: the box's speed checks of the last day)"
    if seconds:
        return Range(x.slow / slow, x.fast / fast, x.source + note)
    return Range(x.slow * slow, x.fast * fast, x.source + note)


def with_spread(r: DeviceRates, slow: float, fast: float) -> DeviceRates:
    """``r`` with its ends ``slow`` and ``fast`` times as fast (``spread_range``)."""
    if slow == fast == 1.0:
        return r

    def rate(x: Range) -> Range:
        return spread_range(x, slow, fast)

    def secs(x: Range | None) -> Range | None:
        return None if x is None else spread_range(x, slow, fast, seconds=True)

    def cost(c: LinearCost) -> LinearCost:
        return LinearCost(secs(c.overhead_s), rate(c.gbps))

    return replace(r, linear={t: cost(c) for t, c in r.linear.items()},
                   fused={t: cost(c) for t, c in r.fused.items()},
                   layers={t: cost(c) for t, c in r.layers.items()},
                   mem_gbps=rate(r.mem_gbps), op_s=secs(r.op_s),
                   layer_s=secs(r.layer_s), token_s=secs(r.token_s))
