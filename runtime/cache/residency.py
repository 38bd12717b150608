"""Residency bookkeeping of the mechanism: keys, pins, reads completing, entries dropped.

A ``Residency`` owns the entries (every expert with a slot or a read, staged prefetches
included), the pins and the prefetch listener, and is given what it works on: the host pool,
the loader, the stats, the RAM policy and the slot table where that maps the host tier. Its
methods keep that state consistent whatever path an expert takes out of the cache:

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
from collections.abc import Collection, Sequence
from concurrent import futures
from concurrent.futures import CancelledError
from typing import Any

from expertfs.errors import UsageError

from ..io import Priority
from ..policies.base import CapacityError, Policy
from .entry import Entry, State, TieredStats
from .loader import Loader
from .sizing import SlotGeometry
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
    """The entries, pins and reads of one cache.

    ``pin_policies`` are the tiers' policies: their ``pinned`` set becomes this one's, so a
    pinned key is no victim in any tier. ``ram_policy`` is the RAM tier's (None: no RAM tier);
    ``host_table`` the slot table when it maps the host tier (None otherwise)."""

    def __init__(self, geo: SlotGeometry, store: Any, host: SlotPool, loader: Loader,
                 stats: TieredStats, *, ram_policy: Policy | None,
                 pin_policies: Sequence[Policy], host_table: SlotTable | None) -> None:
        self.geo = geo
        self.store = store
        self.host = host
        self.loader = loader
        self.stats = stats
        self.R = ram_policy
        self.host_table = host_table
        self.listener: Any = NullListener()
        self.entries: dict[int, Entry] = {}
        self.soft: dict[int, Entry] = {}         # soft pins: prefetches until their layer runs
        self.pins: dict[int, int] = {}           # hard pins: key -> acquires not yet released
        self.pinned: set[int] = set()
        for p in pin_policies:
            p.pinned = self.pinned
        self._index = geo.index_of()
        self._E = geo.n_experts

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
    def pin(self, key: int) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1
        self.pinned.add(key)

    def unpin(self, key: int) -> None:
        n = self.pins.get(key, 0) - 1
        if n > 0:
            self.pins[key] = n
            return
        self.pins.pop(key, None)
        if key not in self.soft:
            self.pinned.discard(key)

    def hold_soft(self, e: Entry, target: tuple[int, int]) -> None:
        """Soft-pin ``e`` (a prefetch) until ``target`` (its layer index, the cursor now) runs."""
        e.target = target
        self.soft[e.key] = e
        self.pinned.add(e.key)

    def unsoft(self, key: int) -> None:
        if self.soft.pop(key, None) is not None and key not in self.pins:
            self.pinned.discard(key)

    def victim(self, p: Policy, key: int) -> int | None:
        try:
            return p.victim(key)
        except CapacityError:
            if not self.soft:
                raise
            for k in list(self.soft):       # demand before prefetch: give up the soft pins
                self.unsoft(k)
            return p.victim(key)

    def touch(self, e: Entry) -> None:
        """A get uses ``e``: a prefetch served its purpose (its soft pin becomes a hard one)."""
        if e.source is not None:
            self.stats.prefetch_used += 1
            self.listener.on_used(e.source, e.nbytes)
            e.source = None
        self.unsoft(e.key)

    def expire(self, li: int, keys: list[int]) -> None:
        """Cancel prefetches whose target layer has been reached without asking for them."""
        n = len(self.geo.layers)
        wanted = set(keys)
        for key, e in list(self.soft.items()):
            tli, c = e.target  # type: ignore[misc]
            if key in wanted or ((li - c) % n or n) < ((tli - c) % n or n):
                continue
            self.unsoft(key)
            if e.source is not None and e.state is State.LOADING and self.stop_read(e, wait=False):
                if self.R is not None and key in self.R:
                    self.R.on_evict(key)
                self.forget(e, cancelled=True)

    # -- entries ----------------------------------------------------------------------------
    def new(self, key: int) -> Entry:
        """An entry for ``key`` in a free host slot (its read is the caller's to issue)."""
        host_slot = self.host.alloc(host_write=True, key=key)
        if host_slot is None:
            raise CapacityError("no free host slot for a read", fix="raise the RAM budget")
        li, ex = divmod(key, self._E)
        e = Entry(key, self.geo.layers[li], ex, self.store.extent(self.geo.layers[li], ex),
                  host_slot=host_slot)
        self.entries[key] = e
        return e

    def staging_read(self, key: int) -> Entry:
        e = self.new(key)
        e.staging = True
        self.loader.issue(e, Priority.DEMAND)
        return e

    def admit_host(self, key: int, now: int) -> None:
        R = self.R
        assert R is not None
        v = self.victim(R, key)
        if v is not None:
            R.on_evict(v)
            self.drop_host(v)
        R.on_insert(key, now)

    # -- reads --------------------------------------------------------------------------------
    def join(self, e: Entry) -> None:
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

    def wait_any(self, entries: Sequence[Entry]) -> None:
        """Block until the read of at least one of ``entries`` is done (time counted as stall);
        their outcomes are the caller's to look at (``wait``)."""
        futs = [self.loader.resolve(e) for e in entries if e.state is State.LOADING]
        if not futs or any(f.done() for f in futs):
            return
        t0 = time.perf_counter()
        try:
            futures.wait(futs, return_when=futures.FIRST_COMPLETED)
        finally:
            self.stats.stall_seconds += time.perf_counter() - t0

    def _outcome(self, e: Entry) -> BaseException | None:
        """Block until ``e``'s read is done and take its outcome: what it raised, or None."""
        fut = self.loader.resolve(e)
        self._block(fut)
        return self._complete(e, fut)

    def wait(self, e: Entry) -> None:
        """Block until ``e``'s read is done; raise what it raised."""
        exc = self._outcome(e)
        if exc is not None:
            raise exc

    def settle(self, e: Entry) -> None:
        """Wait for ``e``'s read and take its outcome without raising it: for the reads of a get
        that already raised (another of its reads failed), so that none is left loading for a
        later get to join and inherit its failure; a failed one leaves nothing resident, as in
        ``wait``."""
        exc = self._outcome(e)
        if exc is not None:
            log.debug("a read of a failed get (layer %d expert %d) failed too: %s", e.layer,
                      e.expert, exc)

    def _complete(self, e: Entry, fut: Any) -> BaseException | None:
        if e.future is not fut or e.state is not State.LOADING:
            return None
        e.future = None
        e.dripped = False
        exc = fut.exception() if not fut.cancelled() else UsageError("read cancelled")
        if exc is not None:
            self.stats.read_errors += 1
            self.discard(e)
            return exc
        self.stats.bytes_read += e.nbytes
        e.state = State.HOST
        if self.host_table is not None and not e.lent:       # (the prompt window's: not kept)
            li, ex = divmod(e.key, self._E)
            self.host_table.set_now(li, ex, e.host_slot)
        return None

    def held(self, skip: Collection[int] = ()) -> int:
        """Experts whose bytes are in the RAM tier, less those of the layers ``skip``."""
        return sum(e.state is State.HOST for e in self.entries.values() if e.layer not in skip)

    def drain(self) -> None:
        """Take note of reads completed since the last call (prefetches, warm start)."""
        for e, fut in self.loader.drain():
            exc = self._complete(e, fut)
            if exc is not None:
                log.debug("a background read of layer %d expert %d failed: %s", e.layer, e.expert, exc)

    # -- dropping -------------------------------------------------------------------------------
    def stop_read(self, e: Entry, *, wait: bool) -> bool:
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

    def drop_host(self, key: int) -> None:
        """The RAM policy evicted ``key``: let its slot go (cancel or finish its read first)."""
        e = self.entries[key]
        self.count_eviction("ram")
        self.unsoft(key)
        cancelled = e.state is State.LOADING and self.stop_read(e, wait=True)
        self.forget(e, cancelled=cancelled)

    def forget(self, e: Entry, *, cancelled: bool = False) -> None:
        if e.source is not None:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_cancelled += cancelled
            self.listener.on_wasted(e.source, 0 if cancelled else e.nbytes, cancelled)
            e.source = None
        self.discard(e)

    def discard(self, e: Entry) -> None:
        """Remove ``e`` from everything (its policy entry is the caller's business, except for
        a failed read, which never counts as resident)."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        if e.state is State.LOADING and not e.staging and self.R is not None and e.key in self.R:
            self.R.on_evict(e.key)
        if self.host_table is not None:
            self.host_table.clear(*divmod(e.key, self._E))
        if e.host_slot >= 0:
            self.host.free(e.host_slot)
        self.unsoft(e.key)
        e.host_slot, e.state, e.weights = -1, State.ABSENT, None

    def count_eviction(self, tier: str) -> None:
        ev = self.stats.evictions
        ev[tier] = ev.get(tier, 0) + 1
