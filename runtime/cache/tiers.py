"""The cache mechanism: slots, residency and the moves between storage, RAM and VRAM.

``TierCache`` executes what the policies decide (``expertfs.runtime.policies.base``); it decides
nothing itself. Its semantics are the replay simulator's (``expertfs.runtime.sim.replay``), call
for call, so hit rates measured on the real thing equal the simulated ones for the same trace:

* one tier (no VRAM budget): a miss evicts the policy's victim and is read into its slot;
* two exclusive tiers: a device hit is served from VRAM (and observed by the RAM policy); a RAM
  hit moves the expert up and frees its RAM slot; a miss is read into a staging slot and
  uploaded; the device victim is demoted to RAM (a device → host copy), whose own victim is
  dropped.

Every expert of an ``acquire`` is pinned until ``release`` of its layer, in both tiers, so the
running layer's slots are never a victim. Prefetches (``start_prefetch``) are *soft* pins until
their target layer runs: they cannot be evicted by one another, and if a demand finds every slot
pinned, soft pins are dropped first. A prefetch whose layer has passed unused is cancelled if
its read has not started (never waited for).

With ``prefetch_slots`` (one tier only) prefetches are *staged* outside the tier instead
(:mod:`.staged`). Reads, uploads and demotions are asynchronous
(futures, copy-stream events); see ``entry``, ``copier``, ``loader``.

Single-threaded: one caller (the forward pass) drives it; I/O workers only append to a deque.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from expertfs.errors import UsageError

from ..experts.protocol import ExpertWeights, weights_from_buffer
from ..io import ExpertReader, PinBudget, Priority
from ..policies.base import CapacityError, Policy
from ..policies.registry import DEFAULT_POLICY, make_factory
from .copier import Copier, fence_done
from .entry import Entry, State, TieredStats
from .loader import Loader
from .residency import NullListener, Residency
from .staged import StagedPrefetch
from .sizing import Geometry, plan_slots
from .slots import SlotPool
from .table import SlotTable

__all__ = ["TierCache"]


class TierCache(StagedPrefetch, Residency):
    def __init__(self, store: Any, reader: ExpertReader, *, device: str | torch.device = "cpu",
                 ram_bytes: int, vram_bytes: int = 0, policy: str | Callable[[int], Policy] = "default",
                 queue_depth: int = 16, staging_slots: int | None = None, pin: bool | str = "auto",
                 pin_budget: PinBudget | None = None, stats: TieredStats | None = None,
                 prefetch_slots: int = 0) -> None:
        self.geo = geo = Geometry.from_store(store)
        self.store = store
        self.device = torch.device(device)
        self.copier = Copier(self.device)
        self.slots = plan_slots(geo, int(ram_bytes), int(vram_bytes), queue_depth=queue_depth,
                                staging=staging_slots, prefetch=prefetch_slots)
        self._index = geo.index_of()
        self._E = geo.n_experts
        if callable(policy):
            factory = policy
        else:
            spec = DEFAULT_POLICY if policy in ("default", "", None) else policy
            factory = make_factory(spec, n_layers=len(geo.layers), route_width=geo.k,
                                   layer_of=geo.layer_of)
        cpu = torch.device("cpu")
        self.host = SlotPool("ram", self.slots.host, geo.slot_bytes, device=cpu, host=True,
                             pin=pin if self.copier.cuda else False, pin_budget=pin_budget)
        self.dev = (SlotPool("vram", self.slots.vram, geo.slot_bytes, device=self.device, host=False)
                    if self.slots.vram else None)
        self.R: Policy | None = factory(self.slots.ram) if self.slots.ram else None
        self.V: Policy | None = factory(self.slots.vram) if self.dev is not None else None
        self.pinned: set[int] = set()
        for p in (self.R, self.V):
            if p is not None:
                p.pinned = self.pinned
        self.policy_name = (self.V or self.R).name  # type: ignore[union-attr]
        # the slot table maps the tier the forward pass reads (none: per-get device copies)
        self.table = (SlotTable(len(geo.layers), self._E, self.device, self.copier)
                      if self.dev is not None or not self.copier.cuda else None)
        self._host_table = self.dev is None and self.table is not None
        # one background read at a time (predictions first, then the warm start): every one
        # costs the decode steps it overlaps (the 6.4 GB model, all of it warming after the
        # first token: 32 tokens in 5.2-5.6 s at depth 1, 8.4-9.2 s at depth 8)
        self.loader = Loader(reader, self.host.view, depth=1)
        self.stats = stats if stats is not None else TieredStats()
        self.listener: Any = NullListener()
        self.entries: dict[int, Entry] = {}
        self.held: dict[int, list[Entry]] = {}
        self.soft: dict[int, Entry] = {}
        self._init_staged()
        self._pins: dict[int, int] = {}
        self.now = 0
        self.cursor = -1                    # layer index of the last acquire
        self.widest = geo.k
        self._layouts: dict[int, int] = {}           # key -> layout id
        self._layout_ids: dict[tuple, int] = {}

    # -- the get path -------------------------------------------------------------------------
    @property
    def defers(self) -> bool:
        """``acquire(wait=False)`` can return before the misses are read: the forward pass
        computes from the RAM tier in place (no device tier, no per-get device copies)."""
        return self.V is None and self.table is not None

    def acquire(self, layer: int, experts: Sequence[int], *, wait: bool = True) -> list[Entry]:
        """Make ``experts`` of ``layer`` resident in the compute tier, pinned until release.

        ``wait=False`` (only where :attr:`defers`): the misses' reads are issued and the
        entries returned at once, those still loading in state LOADING; :meth:`finish` waits
        for them. Everything else (pins, policy, stats) is as with ``wait=True``."""
        if not wait and not self.defers:
            raise UsageError("acquire(wait=False) needs a RAM-tier-only cache computed in place",
                             fix="check TierCache.defers first")
        self.drain()
        keys = list(dict.fromkeys(self.key(layer, e) for e in experts))
        li = keys[0] // self._E if keys else self._index.get(layer, 0)
        cap = self.slots.compute
        pins = self._pins
        if len(keys) + len(pins) > cap and sum(k not in pins for k in keys) + len(pins) > cap:
            raise CapacityError(f"{len(keys)} experts of layer {layer} asked for with "
                                f"{len(pins)} still held, but the compute tier has {cap} "
                                "slots", fix="release layers before the next get, or ask for "
                                "fewer experts per get (prefill: split the batch)")
        if li <= self.cursor:
            self.now += 1
        self.widest = max(self.widest, len(keys))
        if self.soft:
            self._expire(li, keys)
        self.cursor = li
        self._ran_layer(li)
        for k in keys:
            self._pin(k)
        try:
            out = (self._acquire_device(keys) if self.V is not None
                   else self._acquire_host(keys, wait))
        except BaseException:
            self._abort(keys)
            raise
        self.held.setdefault(layer, []).extend(out)
        self.stats.requests += len(keys)
        return out

    def _touch(self, e: Entry) -> None:
        """A get uses ``e``: a prefetch served its purpose (its soft pin becomes a hard one)."""
        if e.source is not None:
            self.stats.prefetch_used += 1
            self.listener.on_used(e.source, e.nbytes)
            e.source = None
        self._unsoft(e.key)

    def finish(self, entries: Sequence[Entry]) -> None:
        """Wait for the reads of entries an ``acquire(wait=False)`` returned still loading
        (stall time counted); raise what a read raised (``release`` still unpins them)."""
        for e in entries:
            if e.state is State.LOADING:
                self._wait(e)

    def _acquire_host(self, keys: list[int], wait: bool = True) -> list[Entry]:
        R, now, entries, soft = self.R, self.now, self.entries, self.soft
        assert R is not None
        out, loading, hits = [], [], 0
        for key in keys:
            if R.access(key, now):
                e = entries[key]
                hits += 1
                if e.state is State.LOADING:
                    self._join(e)
                    loading.append(e)
                if key in soft or e.source is not None:
                    self._touch(e)
            else:
                self.stats.misses += 1
                self._admit_host(key)
                e = self.staged.pop(key, None)
                if e is not None:                   # a staged prediction came true
                    e.staging = False
                    self._touch(e)
                    if e.state is State.LOADING:
                        self._join(e)
                        loading.append(e)
                else:
                    e = self._new(key, self.host.alloc(host_write=True))
                    self.loader.issue(e, Priority.DEMAND)
                    loading.append(e)
            out.append(e)
        if hits:
            self.stats.hits["ram"] = self.stats.hits.get("ram", 0) + hits
        if self.staged:                     # before the waits: the drip resumes after them
            self._drop_unissued(self.cursor)
        if not wait:
            return out
        for e in loading:
            self._wait(e)
        if self.table is None:              # CUDA without a device tier: copies for this get
            for e in out:
                n = e.nbytes
                t, ev = self.copier.transient(self.host.view(e.host_slot)[:n],
                                              after=(self.host.fence[e.host_slot],))
                self.host.fence[e.host_slot] = ev
                self.copier.compute_wait(ev)
                e.transient = t
                e.weights = weights_from_buffer(e.extent, t)
                self.stats.uploads += 1
                self.stats.bytes_h2d += n
        return out

    def _acquire_device(self, keys: list[int]) -> list[Entry]:
        V, R, now, entries, st, soft = self.V, self.R, self.now, self.entries, self.stats, self.soft
        assert V is not None
        reserve = 1 if R is not None else 0     # a demotion's slot while a RAM hit moves up
        for key in keys:                        # reads first, so misses overlap one another
            if key in entries or self.host.n_free <= reserve:
                continue
            self._staging_read(key)
        vh = rh = 0
        for key in keys:
            e = entries.get(key)
            if V.access(key, now):
                vh += 1
                if R is not None:
                    R.observe(key, now)
                if key in soft or e.source is not None:
                    self._touch(e)
                if e.state is State.UPLOADING:      # (its get already made compute wait)
                    if fence_done(e.fence):
                        e.state, e.fence = State.DEVICE, None
                    else:
                        self.copier.compute_wait(e.fence)
                continue
            if R is not None and R.access(key, now):
                rh += 1
                if e.state is State.LOADING:
                    self._join(e)
                    self._wait(e)
                if key in soft or e.source is not None:
                    self._touch(e)
                R.on_evict(key)                  # moves up: exclusive tiers
            else:
                st.misses += 1
                if e is None:
                    e = self._staging_read(key)
                self._wait(e)
            self._upload(e)
        if vh:
            st.hits["vram"] = st.hits.get("vram", 0) + vh
        if rh:
            st.hits["ram"] = st.hits.get("ram", 0) + rh
        return [entries[k] for k in keys]

    def _upload(self, e: Entry) -> None:
        """Host slot → a device slot (after demoting the device victim); frees the host slot."""
        V, dev, host = self.V, self.dev, self.host
        assert V is not None and dev is not None
        d = self._device_slot_for(e.key)
        hs, n = e.host_slot, e.nbytes
        li, ex = divmod(e.key, self._E)
        table = self.table
        assert table is not None
        ev = self.copier.copy_slots(dev, d, host, hs, n, after=(dev.fence[d],),
                                    then=lambda: table.set_now(li, ex, d))
        dev.fence[d] = None                      # later copies queue behind this one
        host.free(hs, ev)
        e.host_slot, e.dev_slot, e.staging, e.weights = -1, d, False, None
        e.state, e.fence = (State.UPLOADING, ev) if ev is not None else (State.DEVICE, None)
        V.on_insert(e.key, self.now)
        self.copier.compute_wait(ev)
        self.stats.uploads += 1
        self.stats.bytes_h2d += n

    def _device_slot_for(self, key: int) -> int:
        V, R, dev = self.V, self.R, self.dev
        assert V is not None and dev is not None
        v = self._victim(V, key)
        if v is None:
            d = dev.alloc(host_write=False)
            assert d is not None, "device policy and slots disagree"
            return d
        V.on_evict(v)
        ve = self.entries[v]
        d = ve.dev_slot
        self._count_eviction("vram")
        assert self.table is not None
        self.table.clear(*divmod(v, self._E))
        ve.dev_slot, ve.weights, ve.fence = -1, None, None
        if R is None:
            self._forget(ve)
            return d
        try:
            self._admit_host(v)                  # demote: device -> host
        except CapacityError:                    # every RAM key is pinned (a huge get): drop it
            self._forget(ve)
            return d
        hv = self.host.alloc(host_write=False)
        assert hv is not None, "host slots and policy disagree"
        n = ve.nbytes
        self.host.fence[hv] = self.copier.copy_slots(self.host, hv, dev, d, n)
        ve.host_slot, ve.state = hv, State.HOST
        self.stats.demotions += 1
        self.stats.bytes_d2h += n
        return d

    def _abort(self, keys: list[int]) -> None:
        """A failed acquire: unpin its keys, stop its staging reads."""
        for k in keys:
            self._unpin(k)
            e = self.entries.get(k)
            if e is not None and e.staging and k not in self.staged:
                self._stop_read(e, wait=True)
                self._discard(e)

    # -- release, weights -------------------------------------------------------------------------
    def release(self, layer: int) -> None:
        held = self.held.pop(layer, None)
        if not held:
            return
        mark = self.copier.compute_mark()
        dev = self.dev
        for e in held:
            if mark is not None and dev is not None and e.dev_slot >= 0:
                dev.fence[e.dev_slot] = mark
            if e.transient is not None:
                e.transient = e.weights = None
            self._unpin(e.key)

    def weights(self, e: Entry) -> ExpertWeights:
        w = e.weights
        if w is None:
            lay = self._layouts.get(e.key)
            if lay is None:
                lay = self._layouts[e.key] = self._layout_id(e.extent)
            if e.dev_slot >= 0:
                parts = self.dev.parts(e.dev_slot, lay, e.extent)  # type: ignore[union-attr]
            else:
                parts = self.host.parts(e.host_slot, lay, e.extent)
            w = e.weights = ExpertWeights(e.layer, e.expert, parts)
        return w

    def _layout_id(self, extent: Any) -> int:
        """One id per distinct part layout (in practice one per quant mix: a layer's experts are
        slices of the same tensors, so they share their layer's)."""
        sig = tuple((p.role, p.ggml_type, p.ne, p.rel_offset, p.nbytes) for p in extent.parts)
        return self._layout_ids.setdefault(sig, len(self._layout_ids))

    # -- prefetch and warm start ----------------------------------------------------------------
    def start_prefetch(self, layer: int, expert: int, source: str) -> str:
        """Read one expert into the RAM tier ahead of need: "issued", "resident" (already there
        or on its way) or "refused" (no slot to spare)."""
        key = self.key(layer, expert)
        if self.slots.prefetch:
            return self._stage(key, source)
        R = self.R
        room = R is not None and len(self.soft) + self.widest < R.capacity
        e = self.entries.get(key)
        if e is not None:                   # keep it until its layer runs, if there is room
            if room and key not in self.soft:
                e.target = (key // self._E, self.cursor)
                self.soft[key] = e
                self.pinned.add(key)
            return "resident"
        if not room:
            return "refused"
        assert R is not None
        try:
            v = R.victim(key)
        except CapacityError:
            return "refused"
        if v is not None:
            R.on_evict(v)
            self._drop_host(v)
        R.on_insert(key, self.now)
        e = self._new(key, self.host.alloc(host_write=True))
        e.source, e.target = source, (key // self._E, self.cursor)
        self.soft[key] = e
        self.pinned.add(key)
        self.loader.queue_prefetch(e)
        self.stats.prefetch_issued += 1
        return "issued"

    def prefetch_in_flight(self) -> int:
        return sum(1 for e in (*self.soft.values(), *self.staged.values())
                   if e.state is State.LOADING and not (e.future is not None and e.future.done()))

    def expert_bytes(self, layer: int, expert: int) -> int:
        return int(self.store.extent(layer, expert).length)

    def _expire(self, li: int, keys: list[int]) -> None:
        """Cancel prefetches whose target layer has been reached without asking for them."""
        n = len(self.geo.layers)
        wanted = set(keys)
        for key, e in list(self.soft.items()):
            tli, c = e.target  # type: ignore[misc]
            if key in wanted or ((li - c) % n or n) < ((tli - c) % n or n):
                continue
            self._unsoft(key)
            if e.source is not None and e.state is State.LOADING and self._stop_read(e, wait=False):
                if self.R is not None and key in self.R:
                    self.R.on_evict(key)
                self._forget(e, cancelled=True)

    def warm(self, rates: Mapping[tuple[int, int], float]) -> int:
        """Fill the RAM tier with the experts of highest learned rate, read at prefetch priority
        in the background. Returns how many reads were queued."""
        R = self.R
        if R is None or not rates:
            return 0
        keyed = {}
        for (layer, ex), r in rates.items():
            li = self._index.get(layer)
            if li is not None and 0 <= ex < self.geo.experts[li]:
                keyed[li * self._E + ex] = r
        todo = []
        for key in R.seed(keyed, self.now):
            e = self._new(key, self.host.alloc(host_write=True))
            todo.append(e)
        self.loader.queue_warm(todo)
        self.stats.warm_issued += len(todo)
        self.stats.warm_bytes += sum(e.nbytes for e in todo)
        return len(todo)

    def close(self) -> None:
        self.loader.close()
        self.copier.synchronize()
        self.held.clear()
        self.host.close()
        self.dev = None
