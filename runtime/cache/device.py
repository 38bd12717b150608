"""The device tier: experts in VRAM slots above the RAM tier, the two tiers exclusive.

A device hit is served from VRAM (and observed by the RAM policy); a RAM hit moves the expert
up and frees its RAM slot; a miss is read into a staging slot and uploaded. The device victim
is demoted to RAM (a device → host copy), whose own victim is dropped; without a RAM tier, or
when every RAM key is pinned, it is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..policies.base import CapacityError, Policy
from .copier import fence_done
from .entry import Entry, State, TieredStats, landed
from .residency import Residency
from .slots import SlotPool
from .table import SlotTable

__all__ = ["DeviceTier"]


class DeviceTier:
    """The VRAM slots ``pool`` under ``policy``, over the host pool and ``ram_policy`` (None:
    staging slots only); ``table`` maps the device slots for the forward pass. Entries, pins
    and reads go through ``residency``."""

    def __init__(self, pool: SlotPool, policy: Policy, *, host: SlotPool,
                 ram_policy: Policy | None, table: SlotTable, copier: Any,
                 residency: Residency, stats: TieredStats, n_experts: int) -> None:
        self.pool = pool
        self.V = policy
        self.host = host
        self.R = ram_policy
        self.table = table
        self.copier = copier
        self.residency = residency
        self.stats = stats
        self._E = n_experts
        self.pending: dict[int, int] = {}        # key -> its device slot, read not yet uploaded

    def acquire(self, keys: list[int], now: int, *, wait: bool = True) -> list[Entry]:
        """Make ``keys`` (pinned by the caller) resident in VRAM, in the order asked for.

        The policies see every key in routing order, each given its device slot at once; the
        upload of every expert whose bytes are in RAM (device misses that are RAM hits, and
        reads already landed) is queued then, before any read is waited for. The others are
        *pending*: ``wait=False`` returns with them still reading (:meth:`finish` uploads them
        as their reads land), ``wait=True`` finishes them in the order their reads land."""
        V, R, res, st = self.V, self.R, self.residency, self.stats
        entries, soft = res.entries, res.soft
        reserve = 1 if R is not None else 0     # a demotion's slot while a RAM hit moves up
        for key in keys:                        # reads first, so misses overlap one another
            if key in entries or self.host.n_free <= reserve:
                continue
            res.staging_read(key)
        vh = rh = 0
        pending = []
        for key in keys:
            e = entries.get(key)
            if V.access(key, now):
                vh += 1
                if R is not None:
                    R.observe(key, now)
                if key in soft or e.source is not None:
                    res.touch(e)
                if e.state is State.UPLOADING:      # (its get already made compute wait)
                    if fence_done(e.fence):
                        e.state, e.fence = State.DEVICE, None
                    else:
                        self.copier.compute_wait(e.fence)
                continue
            if R is not None and R.access(key, now):
                rh += 1
                if e.state is State.LOADING:
                    res.join(e)                  # issued or promoted to demand, not waited for
                if key in soft or e.source is not None:
                    res.touch(e)
                R.on_evict(key)                  # moves up: exclusive tiers
            else:
                st.misses += 1
                if e is None:
                    self._make_room()
                    e = res.staging_read(key)
            d = self._slot_for(key, now)
            V.on_insert(key, now)
            if e.state is State.LOADING:
                self.pending[key] = d
                pending.append(e)
            else:
                self._upload(e, d)
        if vh:
            st.hits["vram"] = st.hits.get("vram", 0) + vh
        if rh:
            st.hits["ram"] = st.hits.get("ram", 0) + rh
        self.finish(pending if wait else [e for e in pending if landed(e)])
        return [entries[k] for k in keys]

    def is_pending(self, e: Entry) -> bool:
        """``e`` has a device slot but its read has not been waited for and uploaded yet."""
        return self.pending.get(e.key) is not None and e.dev_slot < 0

    def finish(self, entries: Sequence[Entry], *, some: bool = False) -> list[Entry]:
        """Upload the pending ``entries`` as their reads land (whichever lands first goes
        first, never routing order); ``some``: return once at least one is uploaded. Returns
        the entries uploaded. A failed read gives its device slot back and raises."""
        todo = [e for e in entries if self.is_pending(e)]
        done: list[Entry] = []
        while todo:
            now = [e for e in todo if landed(e)]
            if not now:
                self.residency.wait_any(todo)
                continue
            for e in now:
                todo.remove(e)
                d = self.pending.pop(e.key)
                if e.state is State.LOADING:
                    try:
                        self.residency.wait(e)   # landed: raises a failed read, never blocks
                    except BaseException:
                        self._give_back(e.key, d)
                        raise
                self._upload(e, d)
                done.append(e)
            if some:
                break
        return done

    def abandon(self, keys: Sequence[int]) -> None:
        """Drop the pending experts among ``keys`` (a failed or unfinished get): their reads
        are stopped or waited for, their device slots given back."""
        res = self.residency
        for key in keys:
            d = self.pending.pop(key, None)
            if d is None:
                continue
            e = res.entries.get(key)
            if e is not None:
                if e.state is State.LOADING:
                    res.stop_read(e, wait=True)
                res.discard(e)
            self._give_back(key, d)

    def _give_back(self, key: int, d: int) -> None:
        if key in self.V:
            self.V.on_evict(key)
        self.pool.free(d)

    def _make_room(self) -> None:
        """Before a host slot is taken: while none is free, finish the pending upload whose read
        lands first (its host slot is freed once the copy is queued)."""
        while self.host.n_free == 0 and self.pending:
            keys = list(self.pending)
            self.finish([self.residency.entries[k] for k in keys], some=True)

    def _upload(self, e: Entry, d: int) -> None:
        """Host slot → device slot ``d`` (its victim already demoted); frees the host slot."""
        dev, host, table = self.pool, self.host, self.table
        hs, n = e.host_slot, e.nbytes
        li, ex = divmod(e.key, self._E)
        ev = self.copier.copy_slots(dev, d, host, hs, n, after=(dev.fence[d],),
                                    then=lambda: table.set_now(li, ex, d))
        dev.fence[d] = None                      # later copies queue behind this one
        host.free(hs, ev)
        e.host_slot, e.dev_slot, e.staging, e.weights = -1, d, False, None
        e.state, e.fence = (State.UPLOADING, ev) if ev is not None else (State.DEVICE, None)
        self.copier.compute_wait(ev)
        self.stats.uploads += 1
        self.stats.bytes_h2d += n

    def _slot_for(self, key: int, now: int) -> int:
        V, dev, res, R = self.V, self.pool, self.residency, self.R
        if self.host.n_free == 0 and R is not None and len(R) < R.capacity:
            self._make_room()                    # a demotion may need a free host slot
        v = res.victim(V, key)
        if v is None:
            d = dev.alloc(host_write=False)
            assert d is not None, "device policy and slots disagree"
            return d
        V.on_evict(v)
        ve = res.entries[v]
        d = ve.dev_slot
        res.count_eviction("vram")
        self.table.clear(*divmod(v, self._E), slot=d)
        ve.dev_slot, ve.weights, ve.fence = -1, None, None
        if self.R is None:
            res.forget(ve)
            return d
        try:
            res.admit_host(v, now)               # demote: device -> host
        except CapacityError:                    # every RAM key is pinned (a huge get): drop it
            res.forget(ve)
            return d
        hv = self.host.alloc(host_write=False)
        assert hv is not None, "host slots and policy disagree"
        n = ve.nbytes
        self.host.fence[hv] = self.copier.copy_slots(self.host, hv, dev, d, n)
        ve.host_slot, ve.state = hv, State.HOST
        self.stats.demotions += 1
        self.stats.bytes_d2h += n
        return d
