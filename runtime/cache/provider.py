"""The tiered provider: experts cached in VRAM and pinned RAM, read from the store on a miss,
prefetched ahead of need, warmed from what earlier runs used.

::

    p = TieredProvider(store, device="cuda", ram_bytes=16 << 30, vram_bytes=20 << 30)
    w = p.get(layer, ids)          # {id: ExpertWeights} on the device; blocking
    ready, rest = p.get_begin(layer, ids)   # or: those resident now, rest() waits for the others
    ...                            # compute layer
    p.release(layer)               # its slots may be evicted again
    p.prefetch(layer + 1, ids2)    # gate lookahead; never blocks
    p.close()                      # records usage in the store for the next warm start

The mechanism is :class:`expertfs.runtime.cache.TierCache` (exclusive tiers, the replay
simulator's semantics, policy by name from ``expertfs.runtime.policies.registry``). On top of it:

* **prefetch**: ``prefetch(layer, ids, source="gate")`` and, with ``history=True``, the
  :class:`~expertfs.runtime.prefetch.HistoryPredictor` (fed by every ``get``, predicting the next
  layer) go through one :class:`~expertfs.runtime.prefetch.Prefetcher`, with coverage, waste
  and late bytes per source (``prefetch_report()``);
* **learned usage**: every routed expert is counted and added to the store's usage table on
  ``close`` (one transaction, merged with earlier runs); with ``warm_start`` the RAM tier is
  filled at start with the most used experts (all of them when they all fit), in the background
  at prefetch priority, one read at a time and none while a demand read is in flight;
  ``warm_held=True`` queues it but issues nothing until ``resume_warm()`` (the engine resumes
  it at the first logits).

``prefetch_slots`` (RAM tier only) stages prefetches outside the tier, so wrong predictions
evict nothing (see ``TierCache``); without it they are read into the tier itself.

Under a memory cap (a cgroup, ``EXPERTFS_MEMORY_LIMIT``: ``runtime.memory``) the reads keep
no copy in the page cache (``drop_behind``: auto reads direct where it can, else buffered reads
drop their pages once copied): the cap charges the page cache to this process, and the tier
already holds what was read. Without a cap the page cache is the kernel's spare memory.

Budgets are explicit and never exceeded: ``ram_bytes`` is the whole host slab (staging
included), ``vram_bytes`` the device slab. ``device="cuda"`` with no VRAM budget copies each
get's experts to the device (freed at release). Tiers are named ``vram`` and ``ram`` in stats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from expertfs.errors import StoreError

from . import State, TierCache, TieredStats, UsageRecorder, load_rates, persist_usage
from ..io import ExpertReader, IOBackend, PinBudget
from ..memory import limit_and_source
from ..policies.base import Policy
from ..prefetch import HistoryPredictor, Prefetcher
from ..experts.protocol import (BoundedGet, ExpertProvider, ExpertWeights, PrefetchReport,
                                SplitGet, TierState, WarmStart)

__all__ = ["TieredProvider"]

log = logging.getLogger(__name__)

_IN_TIME = (State.HOST, State.UPLOADING, State.DEVICE)


def _warm_rates(store: Any, geo: Any, ram_policy: Policy | None) -> dict[tuple[int, int], float]:
    """What warm start loads: the learned usage, hottest first; and when the RAM tier holds every
    routed expert a decode step can ask for, all of them (the rest at rate 0), as an mmap'd model
    ends up in the page cache. A NextN/MTP block's experts are not among those: only speculative
    drafts route through them, and their learned usage (from runs with drafts) is what brings
    them in; reading them all would take the drive and fresh memory for experts a run without
    drafts never uses (a fifth of the experts of a five-layer cut)."""
    rates = load_rates(store, geo.k)
    every = [(la, e) for la, n in zip(geo.layers, geo.experts) if la not in geo.drafts
             for e in range(n)]
    if ram_policy is not None and ram_policy.capacity >= len(every):
        rates = {**dict.fromkeys(every, 0.0), **rates}
    return rates


class TieredProvider(ExpertProvider, SplitGet, BoundedGet, WarmStart, TierState, PrefetchReport):
    def __init__(self, store: Any, *, device: str | torch.device = "cpu", ram_bytes: int,
                 vram_bytes: int = 0, policy: str | Callable[[int], Policy] = "default",
                 backend: str | IOBackend = "auto", queue_depth: int = 16, warm_start: bool = True,
                 history: bool = False, history_budget: int | None = None,
                 max_in_flight: int | None = None, staging_slots: int | None = None,
                 pin: bool | str = "auto", pin_budget: PinBudget | None = None,
                 record_usage: bool = True, verify: str = "first",
                 reader: ExpertReader | None = None, prefetch_slots: int = 0,
                 warm_held: bool = False, drop_behind: bool | None = None,
                 ram_tier: str = "auto") -> None:
        self.store = store
        self.ram_bytes, self.vram_bytes = int(ram_bytes), int(vram_bytes)
        self.stats = TieredStats()
        if drop_behind is None:       # under a cap the page cache is charged to this process
            drop_behind = limit_and_source()[1] != "physical"
        self.reader = reader or ExpertReader(store, backend=backend, queue_depth=queue_depth,
                                             verify=verify, drop_behind=drop_behind)
        try:
            self.cache = TierCache(store, self.reader, device=device, ram_bytes=ram_bytes,
                                   vram_bytes=vram_bytes, policy=policy, queue_depth=queue_depth,
                                   staging_slots=staging_slots, pin=pin, pin_budget=pin_budget,
                                   stats=self.stats, prefetch_slots=prefetch_slots,
                                   ram_tier=ram_tier)
        except BaseException:
            if reader is None:
                self.reader.close()
            raise
        geo = self.cache.geo
        self.device = self.cache.device
        self.prefetcher = Prefetcher(self.cache, max_in_flight=max_in_flight or queue_depth)
        self.cache.listener = self.prefetcher
        self.history = HistoryPredictor(len(geo.layers), geo.n_experts) if history else None
        self.history_budget = history_budget or geo.k
        self.usage = UsageRecorder(geo.k) if record_usage else None
        layers = geo.layers
        self._index = geo.index_of()
        self._next = {la: layers[(i + 1) % len(layers)] for i, la in enumerate(layers)}
        self._closed = False
        if warm_held:
            self.cache.loader.hold()
        if warm_start:
            self.cache.warm(_warm_rates(store, geo, self.cache.R))

    def hold_warm(self) -> None:
        """Issue no more warm-start reads until ``resume_warm`` (those in flight finish)."""
        self.cache.loader.hold()

    def resume_warm(self) -> None:
        self.cache.loader.go()

    # -- the protocol ---------------------------------------------------------------------------
    def get(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        weights = self.cache.weights
        return {e.expert: weights(e) for e in self._acquire(layer, experts, True)}

    def get_begin(self, layer: int, experts: Sequence[int]
                  ) -> tuple[dict[int, ExpertWeights], Callable[..., dict[int, ExpertWeights]]]:
        """``get`` in two halves, so a layer can compute its resident experts while the others
        load: the weights of the experts ready now, and a function that waits for the rest and
        returns theirs (``finish(only)``: waits for and returns only those of ``only``, so a
        batch can compute each expert as its read lands; ``finish(only, some=True)``: waits
        until at least one of them is ready and returns those ready, whichever landed first).
        With a device tier, every expert already in RAM is uploaded before this returns and
        the others as their reads land. Where the cache cannot defer (per-get device copies),
        everything is ready."""
        if not self.cache.defers:
            return self.get(layer, experts), lambda only=None, some=False: {}
        cache = self.cache
        entries = self._acquire(layer, experts, False)
        weights = cache.weights
        pending = cache.waiting(entries)
        ready = {e.expert: weights(e) for e in entries if e not in pending}

        def finish(only: Sequence[int] | None = None, *, some: bool = False
                   ) -> dict[int, ExpertWeights]:
            part = pending if only is None else [e for e in pending if e.expert in only]
            done = cache.finish(part, some=some)
            for e in done:
                if e in pending:
                    pending.remove(e)
            return {e.expert: weights(e) for e in done}
        return ready, finish

    def _acquire(self, layer: int, experts: Sequence[int], wait: bool) -> list:
        cache = self.cache
        cache.drain()
        if self.prefetcher.active(layer):
            ids = [int(e) for e in experts]
            self.prefetcher.on_route(layer, ids, [cache.state_of(cache.key(layer, e)) in _IN_TIME
                                                  for e in ids])
        entries = cache.acquire(layer, experts, wait=wait)
        if self.usage is not None:
            self.usage.add(layer, [e.expert for e in entries])
        if self.history is not None and entries:
            li = self._index[layer]
            self.history.observe(li, [e.expert for e in entries])
            nxt = self._next[layer]
            pred = self.history.predict(self._index[nxt], self.history_budget)
            if pred:
                self.prefetcher.submit("history", nxt, pred)
        return entries

    def release(self, layer: int) -> None:
        self.cache.release(layer)

    def prefetch(self, layer: int, experts: Sequence[int], source: str = "gate") -> None:
        """Start reads of ``experts`` of ``layer`` into RAM if there is room; never blocks on
        storage. ``source`` names the predictor in ``prefetch_report()``."""
        if self._closed or layer not in self._index:
            return
        self.cache.drain()
        self.prefetcher.submit(source, layer, experts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.usage is not None:
                try:
                    persist_usage(self.store, *self.usage.take())
                except StoreError as e:
                    log.warning("%s", e)
        finally:
            self.cache.loader.close()    # the warm drip issues nothing more
            self.reader.close()          # reads in flight finish before their slots go away
            self.cache.close()

    def __enter__(self) -> TieredProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for the forward pass and the status line ---------------------------------------------------
    @property
    def slot_table(self) -> torch.Tensor | None:
        """``[layer_index, expert] -> slot`` (int32, on the compute device; -1: not resident)
        of the tier ``get`` serves from; None when each get is copied to the device."""
        t = self.cache.table
        return None if t is None else t.device

    @property
    def compute_slab(self) -> torch.Tensor | None:
        """The slab ``slot_table`` indexes, as ``[slots, stride]`` uint8."""
        if self.cache.table is None:
            return None
        pool = self.cache.dev if self.cache.dev is not None else self.cache.host
        return pool.rows()

    @property
    def max_experts_per_get(self) -> int:
        """How many experts one ``get`` may ask for now (the compute tier's slots less those
        held by layers not yet released; while the prompt window is open, its free slots):
        split wider requests (prefill batches)."""
        n = self.cache.slots.compute - self.cache.n_held
        window = self.cache.window
        return min(n, max(1, window.room())) if window.open else n

    def layer_index(self, layer: int) -> int:
        return self._index[layer]

    def is_resident(self, layer: int, expert: int) -> bool:
        return self.cache.state_of(self.cache.key(layer, expert)) != State.ABSENT

    def prefetch_in_flight(self) -> int:
        return self.cache.prefetch_in_flight()

    def prefetch_report(self) -> dict[str, dict[str, Any]]:
        return self.prefetcher.report()

    def settled(self) -> bool:
        """Every expert a decode step routes to is in the RAM tier and nothing is being read
        (``TierCache.settled``)."""
        return self.cache.settled()

    def describe(self) -> dict[str, Any]:
        c = self.cache
        s = c.slots
        return {
            "policy": c.policy_name, "device": str(c.device), "slot_bytes": c.geo.stride,
            "ram_slots": s.ram, "staging_slots": s.staging, "vram_slots": s.vram,
            "compute_slots": s.compute, "prefetch_slots": s.prefetch,
            "ram_bytes": c.host.nbytes, "vram_bytes": c.dev.nbytes if c.dev is not None else 0,
            "pinned": c.host.pinned, "pinned_bytes": c.host.pinned_bytes,
            "pin_note": c.host.pin_note, "ram_tier": c.host.kind,
            "backend": self.reader.backend_name, "history": self.history is not None,
        }
