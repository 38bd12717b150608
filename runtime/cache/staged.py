"""Staged prefetch: predicted experts read into slots of their own, outside the RAM tier.

With ``prefetch_slots`` (one tier only, :func:`.sizing.plan_slots`) a prefetch does not enter
the tier and its policy, so a wrong prediction evicts nothing. When a get asks for a staged
expert, the tier takes it exactly as the demand miss it saves (the policy sees the same miss,
victim and insert), minus the read. The tier's contents, and so its hit rate, are those of a
run without prefetch; predictions only turn misses' waits into hits. Staged experts are kept,
the oldest reused first, until their slots are wanted; those still queued for the loader's
drip when their layer runs without them are dropped unread.
"""

from __future__ import annotations

from .entry import Entry, State
from .residency import Residency
from .sizing import Slots

__all__ = ["StagedPrefetch"]


class StagedPrefetch(Residency):
    """Mixed into :class:`.tiers.TierCache`: it calls ``_init_staged`` once and ``_ran_layer``
    at every acquire, and takes a staged entry out of ``staged`` when a get asks for it."""

    slots: Slots

    def _init_staged(self) -> None:
        self.staged: dict[int, Entry] = {}       # staged prefetches, oldest first
        self._ran: dict[int, int] = {}           # layer index -> acquire count at its last run
        self._acquires = 0

    def _ran_layer(self, li: int) -> None:
        """An acquire of layer index ``li``: staged prefetches issued before it for that layer
        may give up their slots from now on."""
        self._acquires += 1
        self._ran[li] = self._acquires

    def _stage(self, key: int, source: str) -> str:
        """``start_prefetch`` with prefetch slots: read into a slot outside the tier."""
        if key in self.entries:
            return "resident"
        if len(self.staged) >= self.slots.prefetch and not self._reclaim():
            return "refused"
        e = self._new(key, self.host.alloc(host_write=True))
        e.staging, e.source = True, source
        e.staged_at = self._acquires
        self.staged[key] = e
        self.loader.queue_prefetch(e)
        self.stats.prefetch_issued += 1
        return "issued"

    def _drop_unissued(self, li: int) -> None:
        """Layer index ``li`` has taken its experts: its staged predictions still queued for the
        drip were wrong, and are dropped unread."""
        for key, e in list(self.staged.items()):
            if key // self._E == li and self.loader.unqueue(e):
                del self.staged[key]
                self._forget(e, cancelled=True)

    def _reclaim(self) -> bool:
        """Free the slot of the oldest staged prefetch whose layer has run since it was issued
        and whose read is not running (done, or cancelled before it started)."""
        for key, e in self.staged.items():
            if self._ran.get(key // self._E, -1) <= e.staged_at:
                continue
            if e.state is State.LOADING and not self._stop_read(e, wait=False):
                continue                    # being written: leave it
            del self.staged[key]
            self._forget(e, cancelled=e.state is State.LOADING)
            return True
        return False
