"""Cache policies: which resident experts to keep. Pure: no I/O, no wall clock, no buffers.

One interface, driven by the cache mechanism (or the simulator) with a logical clock ``now``
(the token index; any non-decreasing number works, and a fake clock in tests)::

    hit = p.access(key, now)          # a use; True when key is resident
    if not hit:
        v = p.victim(key)             # None while there is a free slot, else the key to evict
        if v is not None: p.on_evict(v)
        p.on_insert(key, now)         # (p.admit(key, now) does these three)
    p.pinned                          # keys in use by the running layer: never a victim (mutate it)

``capacity`` is in slots (the mechanism's fixed-size expert slots). ``observe(key, now)`` tells a
lower tier about a use served above it (only frequency policies care). ``seed(rates, now)``
warms a cache from learned usage (per-token access rates, see ``usage_rates``) and returns the
keys it made resident. A hit is a few dict operations (``bench/bench_cache_hit.py``).
Policies here: LRU, LFU with exponential decay (``half_life=None``: plain LFU); ARC and per-layer
quotas live in ``policies.arc`` and ``policies.layer``; ``make_policy`` builds any of them by name.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Any

from ...errors import UsageError

__all__ = ["Key", "Policy", "LRU", "DecayLFU", "usage_rates", "CapacityError"]

Key = Hashable


class CapacityError(UsageError):
    """Every resident key is pinned: the tier has fewer slots than the running layer needs."""


class Policy(ABC):
    """Base of every policy; see the module docstring for the protocol."""

    name = "policy"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise UsageError(f"{self.name}: capacity {capacity} slots", fix="give at least 1 slot")
        self.capacity = capacity
        self.pinned: set[Key] = set()

    @abstractmethod
    def access(self, key: Key, now: float) -> bool:
        """Record a use of ``key``; True when it is resident. A miss leaves residency unchanged."""

    @abstractmethod
    def victim(self, incoming: Key) -> Key | None:
        """The unpinned resident key to evict to make room for ``incoming``; None if it fits."""

    @abstractmethod
    def on_insert(self, key: Key, now: float) -> None:
        """``key`` became resident."""

    @abstractmethod
    def on_evict(self, key: Key) -> None:
        """``key`` is no longer resident."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:         # an empty cache is still a cache (``if policy:``)
        return True

    def observe(self, key: Key, now: float) -> None:
        """A use of ``key`` served by a faster tier (statistics only; default: ignored)."""

    def admit(self, key: Key, now: float) -> Key | None:
        """Make ``key`` resident, evicting if needed; returns the evicted key or None."""
        v = self.victim(key)
        if v is not None:
            self.on_evict(v)
        self.on_insert(key, now)
        return v

    def seed(self, rates: Mapping[Key, float], now: float) -> list[Key]:
        """Warm start: make the hottest keys resident (coldest first, so LRU order matches)."""
        hot = sorted(rates, key=lambda k: rates[k], reverse=True)[:self.capacity - len(self)]
        out = []
        for key in reversed(hot):
            if key not in self:
                self.admit(key, now)
                out.append(key)
        return out

    def _full_error(self) -> CapacityError:
        return CapacityError(f"{self.name}: all {self.capacity} slots are pinned by the running "
                             "layer", fix="give this tier at least k slots (k per layer with quotas)")


class LRU(Policy):
    """Least recently used: evict the key whose last use is oldest."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._od: OrderedDict[Key, None] = OrderedDict()

    def access(self, key: Key, now: float) -> bool:
        od = self._od
        if key in od:
            od.move_to_end(key)
            return True
        return False

    def victim(self, incoming: Key) -> Key | None:
        if len(self._od) < self.capacity:
            return None
        pinned = self.pinned
        for key in self._od:            # oldest first; pinned keys are few and recent
            if key not in pinned:
                return key
        raise self._full_error()

    def on_insert(self, key: Key, now: float) -> None:
        self._od[key] = None

    def on_evict(self, key: Key) -> None:
        del self._od[key]

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def __len__(self) -> int:
        return len(self._od)


class DecayLFU(Policy):
    """LFU with exponential decay: evict the lowest Σ 2^-(now - t_i)/half_life over past uses.

    Uses of non-resident keys are remembered too (the history is bounded by the number of
    experts), so an expert evicted and fetched again keeps its frequency. ``half_life`` is in
    clock units (tokens); ``None`` is plain LFU. Ties go to the least recently used.
    All scores decay at one rate, so their order only changes on a use, and a use only raises a
    score: a heap entry is a lower bound of its key's (score, last use). A hit just updates the
    score; ``victim`` refreshes outdated entries as they reach the top, which keeps it exact.
    """

    name = "lfu"
    _RENORM = 512.0                     # rebase scores when 2^exponent would pass 2^512

    def __init__(self, capacity: int, half_life: float | None = None, *,
                 prior_tokens: float = 64.0) -> None:
        super().__init__(capacity)
        if half_life is not None and half_life <= 0:
            raise UsageError(f"half-life {half_life}", fix="give a half-life > 0 tokens")
        self.half_life = half_life
        self.name = "lfu" if half_life is None else f"lfud@{half_life:g}"
        self._rate = 0.0 if half_life is None else 1.0 / half_life
        self._t0 = 0.0                   # scores are in units of 2^((t - t0) / half_life)
        self._now: float | None = None   # the clock value ``_u`` was computed for
        self._u = 1.0
        self.prior_tokens = prior_tokens
        self._score: dict[Key, float] = {}
        self._last: dict[Key, int] = {}  # key -> sequence number of its last use
        self._resident: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []
        self._seq = 0

    def _unit(self, now: float) -> float:
        if now != self._now:
            e = (now - self._t0) * self._rate
            if e > self._RENORM:
                self._rebase(now)
                e = 0.0
            self._now, self._u = now, 2.0 ** e
        return self._u

    def _rebase(self, now: float) -> None:
        f = 2.0 ** (-(now - self._t0) * self._rate)
        self._t0 = now
        self._score = {k: s * f for k, s in self._score.items()}
        self._rebuild()

    def _rebuild(self) -> None:
        sc, last = self._score, self._last
        self._heap = [(sc[k], last[k], k) for k in self._resident]
        heapq.heapify(self._heap)

    def bump(self, key: Key, now: float, amount: float = 1.0) -> float:
        """Add ``amount`` uses of ``key`` at ``now`` to its score (resident or not)."""
        s = self._score.get(key, 0.0) + amount * (self._u if now == self._now else self._unit(now))
        self._score[key] = s
        self._seq += 1
        self._last[key] = self._seq
        return s

    def access(self, key: Key, now: float) -> bool:
        self.bump(key, now)
        return key in self._resident

    def observe(self, key: Key, now: float) -> None:
        self.bump(key, now)

    def victim(self, incoming: Key) -> Key | None:
        if len(self._resident) < self.capacity:
            return None
        key = self.lowest(self.pinned)
        if key is None:
            raise self._full_error()
        return key

    def lowest(self, pinned: set[Key]) -> Key | None:
        """The resident key with the lowest score that is not in ``pinned`` (None if none)."""
        heap, res, sc, last = self._heap, self._resident, self._score, self._last
        stash = []
        try:
            while heap:
                s, seq, key = heap[0]
                if key not in res:                   # evicted since
                    heapq.heappop(heap)
                elif s != sc[key] or seq != last[key]:   # used since: move it to its place
                    heapq.heapreplace(heap, (sc[key], last[key], key))
                elif key in pinned:
                    stash.append(heapq.heappop(heap))
                else:
                    return key
            return None
        finally:
            for e in stash:
                heapq.heappush(heap, e)

    def score(self, key: Key) -> float:
        """Relative score (comparable between keys at one time, not across rebases)."""
        return self._score.get(key, 0.0)

    def on_insert(self, key: Key, now: float) -> None:
        if key not in self._score:
            self._score[key] = 0.0
            self._seq += 1
            self._last[key] = self._seq
        self._resident.add(key)
        heapq.heappush(self._heap, (self._score[key], self._last[key], key))
        if len(self._heap) > 2 * len(self._resident) + 64:
            self._rebuild()

    def on_evict(self, key: Key) -> None:
        self._resident.remove(key)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def seed(self, rates: Mapping[Key, float], now: float) -> list[Key]:
        """Prior uses: a key used ``r`` times per token gets the score of a steady history."""
        horizon = self.prior_tokens if self._rate == 0 else 1.0 / (self._rate * math.log(2))
        for key, r in rates.items():
            self.bump(key, now, r * horizon)
        self._rebuild()
        return super().seed(rates, now)


def usage_rates(usage: Mapping[Any, float], k: int) -> dict[tuple[int, int], float]:
    """Learned usage counts ``(layer, expert) -> count`` (the store's usage table, or
    ``ExpertKey`` keys) as per-token access rates: count / tokens seen by that layer, where a
    layer's tokens are its total count / k."""
    per: dict[int, float] = {}
    items = [((getattr(key, "layer", None), getattr(key, "expert", None)) if hasattr(key, "layer")
              else tuple(key), float(c)) for key, c in usage.items()]
    for (layer, _), c in items:
        per[layer] = per.get(layer, 0.0) + c
    return {(int(la), int(e)): c * k / per[la] for (la, e), c in items if per[la] > 0}
