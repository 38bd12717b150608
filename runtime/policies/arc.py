"""ARC (Megiddo & Modha, FAST'03): adaptive mix of recency and frequency, for the policy protocol.

Resident keys are split between T1 (seen once recently) and T2 (seen at least twice); ghost lists
B1 and B2 remember keys recently evicted from each. A miss that hits a ghost moves the target
size ``p`` of T1 toward the list that would have kept it, so the cache shifts by itself between
LRU-like and LFU-like behaviour. Ghosts are bounded (|T1|+|B1| <= c, everything <= 2c).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from .base import Key, Policy

__all__ = ["ARC"]


class ARC(Policy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0                                   # target size of T1
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self._in_b2 = False                            # the last miss was a B2 ghost

    def access(self, key: Key, now: float) -> bool:
        if key in self.t2:
            self.t2.move_to_end(key)
            return True
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
            return True
        c, b1, b2 = self.capacity, self.b1, self.b2
        self._in_b2 = key in b2
        if key in b1:
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
        elif self._in_b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
        return False

    def victim(self, incoming: Key) -> Key | None:
        t1, t2 = self.t1, self.t2
        if len(t1) + len(t2) < self.capacity:
            return None
        from_t1 = bool(t1) and (len(t1) > self.p or (self._in_b2 and len(t1) == int(self.p)))
        first, second = (t1, t2) if from_t1 else (t2, t1)
        pinned = self.pinned
        for lst in (first, second):
            for key in lst:
                if key not in pinned:
                    return key
        raise self._full_error()

    def on_insert(self, key: Key, now: float) -> None:
        if key in self.b1 or key in self.b2:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim()

    def on_evict(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None
        self._trim()

    def _trim(self) -> None:
        c, b1, b2 = self.capacity, self.b1, self.b2
        while b1 and len(self.t1) + len(b1) > c:
            b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(b1) + len(b2) > 2 * c:
            (b2 or b1).popitem(last=False)

    def seed(self, rates: Mapping[Key, float], now: float) -> list[Key]:
        """Warm keys go to T2 (frequent), hottest most recent."""
        hot = sorted(rates, key=lambda k: rates[k], reverse=True)[:self.capacity - len(self)]
        out = []
        for key in reversed(hot):
            if key not in self:
                self.admit(key, now)
                self.t1.pop(key, None)
                self.t2[key] = None
                out.append(key)
        return out

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
