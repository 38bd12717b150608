"""Residency bookkeeping shared by the mechanism: keys, pins, reads completing, entries dropped.

``Residency`` is the base of :class:`~expertfs.runtime.cache.tiers.TierCache`: the state it
holds (entries, pins, the host pool, the loader, the policies) is created there; the methods
here keep that state consistent whatever path an expert takes out of the cache:

* **pins**: hard pins (``acquire`` until ``release``; counted) and soft pins (prefetches until
  their layer runs) together form the policies' ``pinned`` set; a demand that finds every
  slot pinned gives up the soft pins first;
* **reads**: completion is noticed by ``drain`` (or waited for by a demand, which *joins* a
  prefetch or warm read in flight: late bytes); a failed read leaves nothing resident;
* **dropping**: an evicted expert still loading is cancelled if its read has not started,
  otherwise waited for (its slot is being written); a prefetched expert dropped unused is waste.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError
from typing import Any

from expertfs.errors import UsageError

from ..io import Priority
from ..policies.base import CapacityError, Policy
from .entry import Entry, State, TieredStats
from .loader import Loader
from .sizing import Geometry
from .slots import SlotPool
from .table import SlotTable

__all__ = ["Residency", "NullListener"]

log = logging.getLogger(__name__)


class NullListener:
    """What the mechanism tells about prefetches (the ``Prefetcher`` implements it)."""

    def on_used(self, source: str, nbytes: int) -> None: ...
    def on_late(self, source: str, nbytes: int) -> None: ...
    def on_wasted(self, source: str, nbytes: int, cancelled: bool) -> None: ...


class Residency:
    geo: Geometry
    store: Any
    host: SlotPool
    table: SlotTable | None
    loader: Loader
    stats: TieredStats
    listener: Any
    R: Policy | None
    entries: dict[int, Entry]
    soft: dict[int, Entry]
    pinned: set[int]
    now: int
    _index: dict[int, int]
    _E: int
    _pins: dict[int, int]
    _host_table: bool

    # -- keys -------------------------------------------------------------------------------
    def key(self, layer: int, expert: int) -> int:
        li = self._index.get(layer)
        if li is None:
            raise UsageError(f"layer {layer} has no routed experts in this store",
                             fix=f"routed layers are {list(self.geo.layers)}")
        if not 0 <= expert < self.geo.experts[li]:
            raise UsageError(f"expert {expert} is outside layer {layer}'s {self.geo.experts[li]}",
                             fix="check the router's ids")
        return li * self._E + int(expert)

    def state_of(self, key: int) -> State:
        e = self.entries.get(key)
        if e is None:
            return State.ABSENT
        if e.state is State.LOADING and e.future is not None and e.future.done():
            return State.HOST
        return e.state

    # -- pins -------------------------------------------------------------------------------
    def _pin(self, key: int) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1
        self.pinned.add(key)

    def _unpin(self, key: int) -> None:
        n = self._pins.get(key, 0) - 1
        if n > 0:
            self._pins[key] = n
            return
        self._pins.pop(key, None)
        if key not in self.soft:
            self.pinned.discard(key)

    def _unsoft(self, key: int) -> None:
        if self.soft.pop(key, None) is not None and key not in self._pins:
            self.pinned.discard(key)

    def _victim(self, p: Policy, key: int) -> int | None:
        try:
            return p.victim(key)
        except CapacityError:
            if not self.soft:
                raise
            for k in list(self.soft):       # demand before prefetch: give up the soft pins
                self._unsoft(k)
            return p.victim(key)

    def _new(self, key: int, host_slot: int | None) -> Entry:
        if host_slot is None:
            raise CapacityError("no free host slot for a read", fix="raise the RAM budget")
        li, ex = divmod(key, self._E)
        e = Entry(key, self.geo.layers[li], ex, self.store.extent(self.geo.layers[li], ex),
                  host_slot=host_slot)
        self.entries[key] = e
        return e

    def _staging_read(self, key: int) -> Entry:
        e = self._new(key, self.host.alloc(host_write=True))
        e.staging = True
        self.loader.issue(e, Priority.DEMAND)
        return e

    def _admit_host(self, key: int) -> None:
        R = self.R
        assert R is not None
        v = self._victim(R, key)
        if v is not None:
            R.on_evict(v)
            self._drop_host(v)
        R.on_insert(key, self.now)

    # -- reads --------------------------------------------------------------------------------
    def _join(self, e: Entry) -> None:
        """A demand found ``e`` still loading (a prefetch or warm read): promote it, count it."""
        fut = self.loader.resolve(e)
        if not fut.done():
            self.stats.joined += 1
            self.stats.late_bytes += e.nbytes
            self.listener.on_late(e.source or "warm", e.nbytes)

    def _block(self, fut: Any) -> None:
        """Wait for a read (time counted as stall); its outcome is the caller's to look at."""
        if fut.done():
            return
        t0 = time.perf_counter()
        try:
            fut.exception()
        except CancelledError:
            pass
        finally:
            self.stats.stall_seconds += time.perf_counter() - t0

    def _wait(self, e: Entry) -> None:
        """Block until ``e``'s read is done; raise what it raised."""
        fut = self.loader.resolve(e)
        self._block(fut)
        exc = self._complete(e, fut)
        if exc is not None:
            raise exc

    def _complete(self, e: Entry, fut: Any) -> BaseException | None:
        if e.future is not fut or e.state is not State.LOADING:
            return None
        e.future = None
        e.dripped = False
        exc = fut.exception() if not fut.cancelled() else UsageError("read cancelled")
        if exc is not None:
            self.stats.read_errors += 1
            self._discard(e)
            return exc
        self.stats.bytes_read += e.nbytes
        e.state = State.HOST
        if self._host_table:
            li, ex = divmod(e.key, self._E)
            self.table.set_now(li, ex, e.host_slot)  # type: ignore[union-attr]
        return None

    def drain(self) -> None:
        """Take note of reads completed since the last call (prefetches, warm start)."""
        for e, fut in self.loader.drain():
            exc = self._complete(e, fut)
            if exc is not None:
                log.debug("a background read of layer %d expert %d failed: %s", e.layer, e.expert, exc)

    # -- dropping -------------------------------------------------------------------------------
    def _stop_read(self, e: Entry, *, wait: bool) -> bool:
        """Stop ``e``'s read before dropping it: True if it never ran (cancelled or still in the
        warm queue), False once it ran (waited for when ``wait``, else left running)."""
        if self.loader.unqueue(e):
            e.future = None
            return True
        fut = e.future
        if fut is None:
            return True
        if fut.cancel():
            e.future = None
            return True
        if wait:
            self._block(fut)
            exc = fut.exception() if not fut.cancelled() else None
            e.future = None
            if exc is None:
                self.stats.bytes_read += e.nbytes
            else:
                self.stats.read_errors += 1
        return False

    def _drop_host(self, key: int) -> None:
        """The RAM policy evicted ``key``: let its slot go (cancel or finish its read first)."""
        e = self.entries[key]
        self._count_eviction("ram")
        self._unsoft(key)
        cancelled = e.state is State.LOADING and self._stop_read(e, wait=True)
        self._forget(e, cancelled=cancelled)

    def _forget(self, e: Entry, *, cancelled: bool = False) -> None:
        if e.source is not None:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_cancelled += cancelled
            self.listener.on_wasted(e.source, 0 if cancelled else e.nbytes, cancelled)
            e.source = None
        self._discard(e)

    def _discard(self, e: Entry) -> None:
        """Remove ``e`` from everything (its policy entry is the caller's business, except for
        a failed read, which never counts as resident)."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        if e.state is State.LOADING and not e.staging and self.R is not None and e.key in self.R:
            self.R.on_evict(e.key)
        if self._host_table:
            self.table.clear(*divmod(e.key, self._E))  # type: ignore[union-attr]
        if e.host_slot >= 0:
            self.host.free(e.host_slot)
        self._unsoft(e.key)
        e.host_slot, e.state, e.weights = -1, State.ABSENT, None

    def _count_eviction(self, tier: str) -> None:
        ev = self.stats.evictions
        ev[tier] = ev.get(tier, 0) + 1
