"""Staged prefetch: predicted experts read into slots of their own, outside the RAM tier.

With ``prefetch_slots`` (one tier only, :func:`.sizing.plan_slots`) a prefetch does not enter
the tier and its policy, so a wrong prediction evicts nothing. When a get asks for a staged
expert, the tier takes it exactly as the demand miss it saves (the policy sees the same miss,
victim and insert), minus the read. The tier's contents, and so its hit rate, are those of a
run without prefetch; predictions only turn misses' waits into hits. Staged experts are kept,
the oldest reused first, until their slots are wanted.
"""

from __future__ import annotations

from ..io import Priority
from .entry import Entry, State
from .residency import Residency
from .sizing import Slots

__all__ = ["StagedPrefetch"]


class StagedPrefetch(Residency):
    """Mixed into :class:`.tiers.TierCache`, which creates the state below."""

    slots: Slots
    staged: dict[int, Entry]             # staged prefetches, oldest first
    _ran: dict[int, int]                 # layer index -> serial of its last acquire
    _serial: int

    def _stage(self, key: int, source: str) -> str:
        """``start_prefetch`` with prefetch slots: read into a slot outside the tier."""
        if key in self.entries:
            return "resident"
        if len(self.staged) >= self.slots.prefetch and not self._reclaim():
            return "refused"
        e = self._new(key, self.host.alloc(host_write=True))
        e.staging, e.source = True, source
        e.target = (key // self._E, self._serial)   # (layer index, acquire serial at issue)
        self.staged[key] = e
        self.loader.issue(e, Priority.PREFETCH)
        self.stats.prefetch_issued += 1
        return "issued"

    def _reclaim(self) -> bool:
        """Free the slot of the oldest staged prefetch whose layer has run since it was issued
        and whose read is not running (done, or cancelled before it started)."""
        for key, e in self.staged.items():
            li, serial = e.target  # type: ignore[misc]
            if self._ran.get(li, -1) <= serial:
                continue
            if e.state is State.LOADING and not self._stop_read(e, wait=False):
                continue                    # being written: leave it
            del self.staged[key]
            self._forget(e, cancelled=e.state is State.LOADING)
            return True
        return False
