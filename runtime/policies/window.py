"""Window LFU: the latest route of every layer kept by recency, everything else by frequency.

Made for MoE decode: consecutive tokens reuse many of each other's experts (recency), and a few
experts per layer are hot all along (frequency). New keys enter a small LRU *window*; a key that
leaves the window meets the frequency region's weakest key in a duel and the one with the lower
decayed use count (``DecayLFU`` score, history kept for evicted keys too) is evicted. This is the
shape of W-TinyLFU (Einziger et al., 2017) with forced admission, since an expert must be
resident to run. A window of ``n_layers × k`` slots holds exactly one route per layer, so a new
expert survives until its layer runs again, whatever the layer order; a smaller window makes
one-off experts fight hot ones before their reuse is seen, and an LRU smaller than the loop of
layers it serves never hits (measured: far worse on sticky traces). So a cache too small for the
window runs without one (pure decayed LFU), where recency policies score zero hits: a tier that
holds less than one token's routes sees every key again only after all the others.
Hits in the frequency region stay there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from .base import DecayLFU, Key, Policy

__all__ = ["WindowLFU"]


class WindowLFU(Policy):
    def __init__(self, capacity: int, window: int, half_life: float | None = 256.0) -> None:
        super().__init__(capacity)
        self.window = window if window <= capacity else 0
        self.main = DecayLFU(capacity, half_life)       # frequency region + the score history
        self.win: OrderedDict[Key, None] = OrderedDict()
        self.name = "wlfu" if half_life is None else f"wlfu@{half_life:g}"

    def access(self, key: Key, now: float) -> bool:
        win = self.win
        if key in win:
            win.move_to_end(key)
            self.main.bump(key, now)
            return True
        return self.main.access(key, now)

    def observe(self, key: Key, now: float) -> None:
        self.main.bump(key, now)

    def _leaving(self, full: bool = True) -> Key | None:
        """The window's least recent unpinned key, when the window is full (``full=False``:
        whatever its fill)."""
        if not self.window or (full and len(self.win) < self.window):
            return None
        pinned = self.pinned
        return next((k for k in self.win if k not in pinned), None)

    def victim(self, incoming: Key) -> Key | None:
        if len(self.win) + len(self.main) < self.capacity:
            return None
        cand = self._leaving()
        weakest = self.main.lowest(self.pinned) if len(self.main) else None
        if cand is None and weakest is None:
            # the frequency region is all pinned (seeded hot keys the running layer uses) and
            # the window not yet full: its least recent unpinned key goes
            cand = self._leaving(full=False)
            if cand is None:
                raise self._full_error()
        if cand is None:
            return weakest
        if weakest is None:
            return cand
        return weakest if self.main.score(cand) > self.main.score(weakest) else cand

    def on_insert(self, key: Key, now: float) -> None:
        if not self.window:
            self.main.on_insert(key, now)
            return
        win = self.win
        win[key] = None
        while len(win) > self.window:
            cand = self._leaving()
            if cand is None:                 # everything in the window is pinned
                break
            del win[cand]
            self.main.on_insert(cand, now)

    def on_evict(self, key: Key) -> None:
        if key in self.win:
            del self.win[key]
        else:
            self.main.on_evict(key)

    def seed(self, rates: Mapping[Key, float], now: float) -> list[Key]:
        """Learned hot keys go straight to the frequency region, with their prior scores, into
        the room the policy has left: the frequency region may hold what the window does not
        (a seed after reads, not only into an empty policy, must evict nothing)."""
        self.main.capacity = self.capacity - len(self.win)
        try:
            return self.main.seed(rates, now)
        finally:
            self.main.capacity = self.capacity

    def __contains__(self, key: object) -> bool:
        return key in self.win or key in self.main

    def __len__(self) -> int:
        return len(self.win) + len(self.main)
