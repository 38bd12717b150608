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

from .entry import Entry, State, TieredStats
from .loader import Loader
from .residency import Residency

__all__ = ["StagedPrefetch"]


class StagedPrefetch:
    """The staged prefetches of one cache, at most ``n_slots`` of them.

    Their entries are created and dropped through ``residency`` (they are resident while
    staged); the owner calls :meth:`ran_layer` at every acquire and :meth:`take` when a get
    asks for an expert that is not in the tier."""

    def __init__(self, residency: Residency, loader: Loader, stats: TieredStats, *,
                 n_slots: int, n_experts: int) -> None:
        self.residency = residency
        self.loader = loader
        self.stats = stats
        self.n_slots = n_slots
        self._E = n_experts
        self.entries: dict[int, Entry] = {}      # staged prefetches, oldest first
        self._ran: dict[int, int] = {}           # layer index -> acquire count at its last run
        self._acquires = 0

    def ran_layer(self, li: int) -> None:
        """An acquire of layer index ``li``: staged prefetches issued before it for that layer
        may give up their slots from now on."""
        self._acquires += 1
        self._ran[li] = self._acquires

    def take(self, key: int) -> Entry | None:
        """The staged entry of ``key``, no longer staged (None if there is none)."""
        e = self.entries.pop(key, None)
        if e is not None:
            e.staging = False
        return e

    def stage(self, key: int, source: str) -> str:
        """``start_prefetch`` with prefetch slots: read into a slot outside the tier."""
        if key in self.residency.entries:
            return "resident"
        if len(self.entries) >= self.n_slots and not self._reclaim():
            return "refused"
        e = self.residency.new(key)
        e.staging, e.source = True, source
        e.staged_at = self._acquires
        self.entries[key] = e
        self.loader.queue_prefetch(e)
        self.stats.prefetch_issued += 1
        return "issued"

    def drop_unissued(self, li: int) -> None:
        """Layer index ``li`` has taken its experts: its staged predictions still queued for the
        drip were wrong, and are dropped unread."""
        for key, e in list(self.entries.items()):
            if key // self._E == li and self.loader.unqueue(e):
                del self.entries[key]
                self.residency.forget(e, cancelled=True)

    def _reclaim(self) -> bool:
        """Free the slot of the oldest staged prefetch whose layer has run since it was issued
        and whose read is not running (done, or cancelled before it started)."""
        for key, e in self.entries.items():
            if self._ran.get(key // self._E, -1) <= e.staged_at:
                continue
            if e.state is State.LOADING and not self.residency.stop_read(e, wait=False):
                continue                    # being written: leave it
            del self.entries[key]
            self.residency.forget(e, cancelled=e.state is State.LOADING)
            return True
        return False
