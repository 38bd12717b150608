"""The device tier: experts in VRAM slots above the RAM tier, the two tiers exclusive.

A device hit is served from VRAM (and observed by the RAM policy); a RAM hit moves the expert
up and frees its RAM slot; a miss is read into a staging slot and uploaded. The device victim
is demoted to RAM (a device → host copy), whose own victim is dropped; without a RAM tier, or
when every RAM key is pinned, it is dropped.
"""

from __future__ import annotations

from typing import Any

from ..policies.base import CapacityError, Policy
from .copier import fence_done
from .entry import Entry, State, TieredStats
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

    def acquire(self, keys: list[int], now: int) -> list[Entry]:
        """Make ``keys`` (pinned by the caller) resident in VRAM, in the order asked for."""
        V, R, res, st = self.V, self.R, self.residency, self.stats
        entries, soft = res.entries, res.soft
        reserve = 1 if R is not None else 0     # a demotion's slot while a RAM hit moves up
        for key in keys:                        # reads first, so misses overlap one another
            if key in entries or self.host.n_free <= reserve:
                continue
            res.staging_read(key)
        vh = rh = 0
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
                    res.join(e)
                    res.wait(e)
                if key in soft or e.source is not None:
                    res.touch(e)
                R.on_evict(key)                  # moves up: exclusive tiers
            else:
                st.misses += 1
                if e is None:
                    e = res.staging_read(key)
                res.wait(e)
            self._upload(e, now)
        if vh:
            st.hits["vram"] = st.hits.get("vram", 0) + vh
        if rh:
            st.hits["ram"] = st.hits.get("ram", 0) + rh
        return [entries[k] for k in keys]

    def _upload(self, e: Entry, now: int) -> None:
        """Host slot → a device slot (after demoting the device victim); frees the host slot."""
        V, dev, host, table = self.V, self.pool, self.host, self.table
        d = self._slot_for(e.key, now)
        hs, n = e.host_slot, e.nbytes
        li, ex = divmod(e.key, self._E)
        ev = self.copier.copy_slots(dev, d, host, hs, n, after=(dev.fence[d],),
                                    then=lambda: table.set_now(li, ex, d))
        dev.fence[d] = None                      # later copies queue behind this one
        host.free(hs, ev)
        e.host_slot, e.dev_slot, e.staging, e.weights = -1, d, False, None
        e.state, e.fence = (State.UPLOADING, ev) if ev is not None else (State.DEVICE, None)
        V.on_insert(e.key, now)
        self.copier.compute_wait(ev)
        self.stats.uploads += 1
        self.stats.bytes_h2d += n

    def _slot_for(self, key: int, now: int) -> int:
        V, dev, res = self.V, self.pool, self.residency
        v = res.victim(V, key)
        if v is None:
            d = dev.alloc(host_write=False)
            assert d is not None, "device policy and slots disagree"
            return d
        V.on_evict(v)
        ve = res.entries[v]
        d = ve.dev_slot
        res.count_eviction("vram")
        self.table.clear(*divmod(v, self._E))
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
