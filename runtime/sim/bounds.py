"""Offline references for a trace: the Belady/OPT bound (the most hits any cache of a given size
could get) and the static-frequency cache (the most a cache gets that knows how often each expert
is used but not when).

Offline MIN (Belady 1966) with demand fetch: every accessed expert must be resident when its
layer runs (it is computed from its slot), so a miss always inserts, evicting the resident key
whose next use is farthest in the future. The running row's keys are pinned, as in the runtime.
Next uses are precomputed in one backward pass; a lazy max-heap keyed by next use makes the
whole replay O(n log n). With ``prefill`` the cache starts holding the ``capacity`` keys used
first (what a free warm start could load), the bound to compare warm-started policies against.

The static-frequency cache pins the ``capacity - w`` experts the whole trace uses most (``w`` the
widest row, whose other keys pass through the remaining slots) and never evicts them. When each
token's route is an independent draw from fixed per-expert frequencies, no policy does better
(Aven, Coffman and Kogan 1987, the independent reference model); a policy beats it only by
exploiting the order of the trace (temporal locality), and Belady's margin over it is knowledge
of that order, which a cache serving tokens as they come does not have. Without ``prefill`` it
is itself a demand-fetch cache (each pinned expert read at its first use), so it never exceeds
Belady at the same capacity; with ``prefill`` its pinned experts start resident (a warm start
from learned usage does the same).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ...errors import UsageError

__all__ = ["next_uses", "check_capacity", "belady_hits", "static_hits"]


def next_uses(seq: Sequence[int]) -> list[int]:
    """For each position i, the next position with the same key (``len(seq)`` if none)."""
    n = len(seq)
    out = [n] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        key = seq[i]
        out[i] = last.get(key, n)
        last[key] = i
    return out


def check_capacity(rows: Sequence[Sequence[int]], capacity: int) -> int:
    """The widest row, after checking that ``capacity`` slots can serve it."""
    if capacity < 1:
        raise UsageError(f"an offline bound for {capacity} slots", fix="give at least 1 slot")
    widest = max((len(r) for r in rows), default=0)
    if widest > capacity:
        raise UsageError(f"a row needs {widest} experts at once but the cache has {capacity} "
                         "slots", fix="give the tier at least k slots")
    return widest


def belady_hits(rows: Sequence[Sequence[int]], capacity: int, *, prefill: bool = False) -> int:
    """Hits of the optimal demand-fetch cache of ``capacity`` slots over ``rows`` of keys
    (each row: the distinct keys one layer of one token needs at once)."""
    check_capacity(rows, capacity)
    seq = [key for row in rows for key in row]
    nxt = next_uses(seq)
    n = len(seq)
    where: dict[int, int] = {}                  # resident key -> its next use
    heap: list[tuple[int, int]] = []            # (-next use, key), lazy
    if prefill:
        for i, key in enumerate(seq):
            if len(where) == capacity:
                break
            if key not in where:
                where[key] = i                  # next use = its first use
                heap.append((-i, key))
        heapq.heapify(heap)
    hits = 0
    i = 0
    for row in rows:
        for key in row:
            nu = nxt[i]
            if key in where:
                hits += 1
            elif len(where) >= capacity:
                stash = []
                while True:
                    neg, v = heapq.heappop(heap)
                    if where.get(v) != -neg:
                        continue                # stale entry
                    if v in row:
                        stash.append((neg, v))  # used by the running row: pinned
                        continue
                    del where[v]
                    break
                for e in stash:
                    heapq.heappush(heap, e)
            where[key] = nu
            heapq.heappush(heap, (-nu, key))
            i += 1
        if len(heap) > 4 * capacity + 64:
            heap = [(-u, k) for k, u in where.items()]
            heapq.heapify(heap)
    assert i == n
    return hits


def static_hits(rows: Sequence[Sequence[int]], capacity: int, *, prefill: bool = False) -> int:
    """Hits of the static-frequency cache of ``capacity`` slots over ``rows`` (module doc): the
    ``capacity - widest row`` most used keys pinned (ties to the lower key), each missing once,
    at its first use, unless ``prefill``."""
    widest = check_capacity(rows, capacity)
    counts: dict[int, int] = {}
    for row in rows:
        for key in row:
            counts[key] = counts.get(key, 0) + 1
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:capacity - widest]
    return sum(c if prefill else c - 1 for _, c in top)
