"""The first reads of a run: ``expertfs run`` starts with empty tiers. Its prompt reads every
expert it touches into them (that is the first token's time, ``plan.prefill``); the decode then
reads once every expert it touches that the prompt did not, and over a short generation that
cost is not amortised away: a run of ``n`` tokens pays ``first_read_bytes / n`` a token on top of
the steady-state misses, which is what ``run``'s decode tok/s measures (its warm start reads the
rest of the RAM tier in the background, at prefetch priority).

New experts are counted as for uniform routing: the most a layer can see in ``n`` tokens after
``P`` prompt tokens is what ``P + n`` tokens touch less what ``P`` touch (skewed routing touches
fewer). Only their hit share counts (misses are read in the steady state anyway), and the fill
never passes the room the prompt left in the tiers. At the slow end ``predict`` gives them half the drive (``WARM_SHARE``)
and never more time than the same experts would take as misses; at the fast end they share the
drive with the misses, overlapped with compute like them."""

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


def first_read_bytes(g: Geometry, hit_rate: float, tokens: int, tier_bytes: int,
                     prompt_tokens: int = 0) -> float:
    """Bytes read once during ``tokens`` decode tokens after a ``prompt_tokens`` prompt, for
    experts that the steady state counts as hits (``hit_rate``: VRAM + RAM hits of the
    routing) and the prompt did not load; bounded by the room the prompt left in ``tier_bytes``
    (what the tiers hold)."""
    hit = min(1.0, max(0.0, hit_rate))
    every = float(sum(g.extent_bytes) * g.n_experts)

    def touched(n: int) -> float:
        return distinct_experts(g.n_experts, g.k, n) / max(1, g.n_experts) * every

    left = max(0.0, tier_bytes - touched(prompt_tokens))      # room the prompt left in the tiers
    return min(left, hit * (touched(prompt_tokens + tokens) - touched(prompt_tokens)))


def first_read_seconds(bytes_total: float, tokens: int, gbps: float) -> float:
    """Seconds a token of a ``tokens``-token generation spends on ``bytes_total`` of first reads
    at ``gbps`` GB/s."""
    if bytes_total <= 0 or tokens <= 0:
        return 0.0
    return bytes_total / tokens / (gbps * 1e9)
