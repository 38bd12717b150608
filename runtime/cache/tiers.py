"""The cache mechanism: slots, residency and the moves between storage, RAM and VRAM.

``TierCache`` executes what the policies decide (``expertfs.runtime.policies.base``); it decides
nothing itself. Its semantics are the replay simulator's (``expertfs.runtime.sim.replay``), call
for call, so hit rates measured on the real thing equal the simulated ones for the same trace:

* one tier (no VRAM budget): a miss evicts the policy's victim and is read into its slot;
* two exclusive tiers (:mod:`.device`): a device hit is served from VRAM (and observed by the
  RAM policy); a RAM hit moves the expert up and frees its RAM slot; a miss is read into a
  staging slot and uploaded; the device victim is demoted to RAM (a device → host copy), whose
  own victim is dropped.

Every expert of an ``acquire`` is pinned until ``release`` of its layer, in both tiers, so the
running layer's slots are never a victim. Prefetches (``start_prefetch``) are *soft* pins until
their target layer runs: they cannot be evicted by one another, and if a demand finds every slot
pinned, soft pins are dropped first. A prefetch whose layer has passed unused is cancelled if
its read has not started (never waited for).

With ``prefetch_slots`` (one tier only) prefetches are *staged* outside the tier instead
(:mod:`.staged`); a prompt's reads of a tier of every expert go through its spare slots
(:mod:`.window`). Reads, uploads and demotions are asynchronous (futures, copy-stream events).
``TierCache`` composes those parts: slot pools, policies, slot table, loader, copier,
``Residency`` (entries, pins, reads, drops), ``StagedPrefetch``, ``PromptWindow`` and, with a
VRAM budget, ``DeviceTier``; it keeps the acquire clock and the layers held until release.

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
from .copier import Copier
from .device import DeviceTier
from .entry import Entry, State, TieredStats, landed
from .loader import Loader
from .residency import Residency
from .sizing import SlotGeometry, plan_slots
from .slots import SlotPool, host_tier
from .staged import StagedPrefetch
from .table import SlotTable
from .window import prompt_window

__all__ = ["TierCache"]


class TierCache:
    def __init__(self, store: Any, reader: ExpertReader, *, device: str | torch.device = "cpu",
                 ram_bytes: int, vram_bytes: int = 0, policy: str | Callable[[int], Policy] = "default",
                 queue_depth: int = 16, staging_slots: int | None = None, pin: bool | str = "auto",
                 pin_budget: PinBudget | None = None, stats: TieredStats | None = None,
                 prefetch_slots: int = 0, ram_tier: str = "auto") -> None:
        self.geo = geo = SlotGeometry.from_store(store)
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
        self.host = host_tier(geo, reader, self.slots.host, cuda=self.copier.cuda,
                              alone=not (self.slots.prefetch or self.slots.vram), pin=pin,
                              pin_budget=pin_budget, ram_tier=ram_tier)
        self.dev = (SlotPool("vram", self.slots.vram, geo.slot_bytes, device=self.device, host=False)
                    if self.slots.vram else None)
        self.R: Policy | None = factory(self.slots.ram) if self.slots.ram else None
        self.V: Policy | None = factory(self.slots.vram) if self.dev is not None else None
        self.policy_name = (self.V or self.R).name  # type: ignore[union-attr]
        # the slot table maps the tier the forward pass reads (none: per-get device copies)
        self.table = (SlotTable(len(geo.layers), self._E, self.device, self.copier)
                      if self.dev is not None or not self.copier.cuda else None)
        # one background read at a time (predictions first, then the warm start): every one
        # slows the decode steps it overlaps, and more in flight slow them more
        self.loader = Loader(reader, self.host.view, depth=1)
        self.stats = stats if stats is not None else TieredStats()
        self.residency = Residency(
            geo, store, self.host, self.loader, self.stats, ram_policy=self.R,
            pin_policies=[p for p in (self.R, self.V) if p is not None],
            host_table=self.table if self.dev is None else None)
        self.stager = StagedPrefetch(self.residency, self.loader, self.stats,
                                     n_slots=self.slots.prefetch, n_experts=self._E)
        self.device_tier: DeviceTier | None = None
        if self.dev is not None and self.V is not None and self.table is not None:
            self.device_tier = DeviceTier(self.dev, self.V, host=self.host, ram_policy=self.R,
                                          table=self.table, copier=self.copier,
                                          residency=self.residency, stats=self.stats,
                                          n_experts=self._E)
        self.window = prompt_window(self)
        self.held: dict[int, list[Entry]] = {}
        self.now = 0
        self.cursor = -1                    # layer index of the last acquire
        self.widest = geo.k
        self._layouts: dict[int, int] = {}           # key -> layout id
        self._layout_ids: dict[tuple, int] = {}

    # -- what the parts hold ----------------------------------------------------------------------
    @property
    def entries(self) -> dict[int, Entry]:
        """Every expert with a slot or a read (staged prefetches included), by key."""
        return self.residency.entries

    @property
    def staged(self) -> dict[int, Entry]:   # the staged prefetches, oldest first
        return self.stager.entries

    @property
    def listener(self) -> Any:       # told about prefetches used, late and wasted (Prefetcher)
        return self.residency.listener

    @listener.setter
    def listener(self, value: Any) -> None:
        self.residency.listener = value

    @property
    def n_held(self) -> int:
        """How many experts are pinned by layers acquired and not yet released."""
        return len(self.residency.pins)

    def key(self, layer: int, expert: int) -> int:
        return self.residency.key(layer, expert)

    def state_of(self, key: int) -> State:
        return self.residency.state_of(key)

    def drain(self) -> None:
        """Take note of reads completed since the last call (prefetches, warm start)."""
        self.residency.drain()

    def settled(self) -> bool:
        """No device tier, nothing queued or read, every expert a decode step routes to in the
        RAM tier: a decode from here reads nothing (an uncapped tier after its warm start)."""
        self.residency.drain()
        return self.dev is None and not self.loader.drip_pending \
            and self.residency.held(self.geo.drafts) >= self.geo.routed

    # -- the get path -------------------------------------------------------------------------
    @property
    def defers(self) -> bool:
        """``acquire(wait=False)`` can return before the misses are read: the forward pass
        computes from the RAM tier in place, or from a device tier (no per-get copies)."""
        return self.table is not None and (self.V is None or self.device_tier is not None)

    def acquire(self, layer: int, experts: Sequence[int], *, wait: bool = True) -> list[Entry]:
        """Make ``experts`` of ``layer`` resident in the compute tier, pinned until release.

        ``wait=False`` (only where :attr:`defers`): the misses' reads are issued and the
        entries returned at once, those still loading in state LOADING; :meth:`finish` waits
        for them. Everything else (pins, policy, stats) is as with ``wait=True``."""
        if not wait and not self.defers:
            raise UsageError("acquire(wait=False) needs a RAM-tier-only cache computed in place",
                             fix="check TierCache.defers first")
        res = self.residency
        res.drain()
        keys = list(dict.fromkeys(res.key(layer, e) for e in experts))
        li = keys[0] // self._E if keys else self._index.get(layer, 0)
        cap = self.slots.compute
        pins = res.pins
        if len(keys) + len(pins) > cap and sum(k not in pins for k in keys) + len(pins) > cap:
            raise CapacityError(f"{len(keys)} experts of layer {layer} asked for with "
                                f"{len(pins)} still held, but the compute tier has {cap} "
                                "slots", fix="release layers before the next get, or ask for "
                                "fewer experts per get (prefill: split the batch)")
        if li <= self.cursor:
            self.now += 1
        self.widest = max(self.widest, len(keys))
        if res.soft:
            res.expire(li, keys)
        self.cursor = li
        self.stager.ran_layer(li)
        for k in keys:
            res.pin(k)
        try:
            out = (self.device_tier.acquire(keys, self.now, wait=wait)
                   if self.device_tier is not None else self._acquire_host(keys, wait))
        except BaseException:
            self._abort(keys)
            raise
        self.held.setdefault(layer, []).extend(out)
        self.stats.requests += len(keys)
        return out

    def waiting(self, entries: Sequence[Entry]) -> list[Entry]:
        """Those of ``entries`` (an ``acquire(wait=False)``'s) that ``finish`` has to wait for."""
        if self.device_tier is not None:
            return [e for e in entries if self.device_tier.is_pending(e)]
        return [e for e in entries if e.state is State.LOADING]

    def finish(self, entries: Sequence[Entry], *, some: bool = False) -> list[Entry]:
        """Wait for the reads of entries an ``acquire(wait=False)`` returned still loading
        (stall time counted; with a device tier, each uploaded as it lands, whichever lands
        first); ``some``: return once at least one is ready (without waiting when one already
        is). Returns those of ``entries`` ready; raises what a read raised (``release`` still
        unpins them)."""
        todo = self.waiting(entries)
        done = [e for e in entries if e not in todo]
        if some and done:
            todo = [e for e in todo if landed(e)]
        if self.device_tier is not None:
            return done + self.device_tier.finish(todo, some=some)
        while todo:
            if some:
                self.residency.wait_any(todo)
            for e in [e for e in todo if not some or landed(e)]:
                todo.remove(e)
                self.residency.wait(e)
                done.append(e)
            if some:
                break
        return done

    def _acquire_host(self, keys: list[int], wait: bool = True) -> list[Entry]:
        R, now, res = self.R, self.now, self.residency
        entries, soft = res.entries, res.soft
        assert R is not None
        out, loading, hits = [], [], 0
        for key in keys:
            if R.access(key, now):
                e = entries[key]
                hits += 1
                w = self.window.take(e) if e.state is State.LOADING else None
                if w is not None:                   # read into the prompt window instead
                    loading.append(w)
                elif e.state is State.LOADING:
                    res.join(e)
                    loading.append(e)
                if key in soft or e.source is not None:
                    res.touch(e)
                e = w or e
            else:
                self.stats.misses += 1
                res.admit_host(key, now)
                e = self.stager.take(key)
                if e is not None:                   # a staged prediction came true
                    res.touch(e)
                    if e.state is State.LOADING:
                        res.join(e)
                        loading.append(e)
                else:
                    e = res.new(key)
                    self.loader.issue(e, Priority.DEMAND)
                    loading.append(e)
            out.append(e)
        if hits:
            self.stats.hits["ram"] = self.stats.hits.get("ram", 0) + hits
        if self.stager.entries:             # before the waits: the drip resumes after them
            self.stager.drop_unissued(self.cursor)
        if not wait:
            return out
        for e in loading:
            res.wait(e)
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

    def _abort(self, keys: list[int]) -> None:
        """A failed acquire: unpin its keys, stop its staging reads, and take the outcome of its
        other reads still in flight (``Residency.settle``)."""
        res = self.residency
        if self.device_tier is not None:
            self.device_tier.abandon(keys)
        for k in keys:
            res.unpin(k)
            e = res.entries.get(k)
            if e is not None and e.staging and k not in self.stager.entries:
                res.stop_read(e, wait=True)
                res.discard(e)
            elif e is not None and e.state is State.LOADING:
                res.settle(e)
        self.window.abandon(self.held)          # the prompt window's entries of this acquire

    # -- release, weights -------------------------------------------------------------------------
    def release(self, layer: int) -> None:
        held = self.held.pop(layer, None)
        if not held:
            return
        if self.device_tier is not None and self.device_tier.pending:   # never finished
            self.device_tier.abandon([e.key for e in held])
        mark = self.copier.compute_mark()
        dev = self.dev
        res = self.residency
        for e in held:
            if mark is not None and dev is not None and e.dev_slot >= 0:
                dev.fence[e.dev_slot] = mark
            if e.transient is not None:
                e.transient = e.weights = None
            res.unpin(e.key)
            if e.lent:                          # the prompt window's (``window``)
                self.window.give_back(e)
            elif e.state is State.LOADING:      # a get that raised before its reads landed
                res.settle(e)                   # (a finished one has none in flight)

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
        res = self.residency
        key = res.key(layer, expert)
        if self.slots.prefetch:
            return self.stager.stage(key, source)
        R = self.R
        room = R is not None and len(res.soft) + self.widest < R.capacity
        e = res.entries.get(key)
        if e is not None:                   # keep it until its layer runs, if there is room
            if room and key not in res.soft:
                res.hold_soft(e, (key // self._E, self.cursor))
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
            res.drop_host(v)
        R.on_insert(key, self.now)
        e = res.new(key)
        e.source = source
        res.hold_soft(e, (key // self._E, self.cursor))
        self.loader.queue_prefetch(e)
        self.stats.prefetch_issued += 1
        return "issued"

    def prefetch_in_flight(self) -> int:
        return sum(1 for e in (*self.residency.soft.values(), *self.stager.entries.values())
                   if e.state is State.LOADING and not (e.future is not None and e.future.done()))

    def expert_bytes(self, layer: int, expert: int) -> int:
        return int(self.store.extent(layer, expert).length)

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
            e = self.residency.new(key)
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
