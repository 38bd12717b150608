"""The first reads of a run: ``expertfs run`` starts with empty tiers, so every expert a
generation touches that would later be a hit is read once from storage during that generation
(its warm start reads the rest in the background). Over a short generation that cost is not
amortised away: a run of ``n`` tokens pays ``first_read_bytes / n`` a token on top of the
steady-state misses, which is what ``run``'s decode tok/s measures. At the slow end
``predict`` gives them half the drive (``WARM_SHARE``) and never more time than the same
experts would take as misses; at the fast end they share the drive with the misses, overlapped
with compute like them.

Distinct experts touched in ``n`` tokens are counted as for uniform routing (the most a layer
can touch; skewed routing touches fewer), only the hit share of them is extra (misses are read
in the steady state anyway), and the fill never passes the tiers."""

from __future__ import annotations

from .geometry import Geometry

__all__ = ["WARM_SHARE", "distinct_experts", "first_read_bytes", "first_read_seconds"]

#: share of the drive the first reads get at the slow end: the warm start reads the rest of the
#: tier at the same time, and at worst takes the other half
WARM_SHARE = 0.5


def distinct_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts of one layer touched by ``tokens`` tokens of top-``k`` routing
    spread uniformly over ``n_experts``."""
    if n_experts <= 0 or k <= 0 or tokens <= 0:
        return 0.0
    k = min(k, n_experts)
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def first_read_bytes(g: Geometry, hit_rate: float, tokens: int, tier_bytes: int) -> float:
    """Bytes read once, during a generation of ``tokens`` tokens from empty tiers, for experts
    that the steady state counts as hits (``hit_rate``: VRAM + RAM hits of the routing);
    bounded by ``tier_bytes`` (what the tiers can hold)."""
    hit = min(1.0, max(0.0, hit_rate))
    d = distinct_experts(g.n_experts, g.k, tokens)
    touched = sum(d * ext for ext in g.extent_bytes)
    return min(float(max(0, tier_bytes)), hit * touched)


def first_read_seconds(bytes_total: float, tokens: int, gbps: float) -> float:
    """Seconds a token of a ``tokens``-token generation spends on ``bytes_total`` of first reads
    at ``gbps`` GB/s."""
    if bytes_total <= 0 or tokens <= 0:
        return 0.0
    return bytes_total / tokens / (gbps * 1e9)
