"""Slot geometry from a store, and byte budgets turned into slots.

A slot holds the store's largest extent rounded up to the page, so the number of experts a
budget holds is ``budget // stride`` whatever their layer. Keys are the simulator's integer keys,
``layer_index * n_experts + expert`` (``layer_index``: position in ``store.layers``, so a store
whose routed layers are 0..L-1 has exactly the keys of a routing trace of it).

With a device tier, misses are read into *staging* host slots and uploaded from there (tiers
are exclusive: the host tier keeps what the device tier does not). Staging slots come out of the
RAM budget, so the host tier's policy capacity is ``host slots - staging``; nothing is ever
allocated beyond the budgets.

Without a device tier, ``prefetch`` slots (opt-in, for the next-layer lookahead) likewise come
out of the RAM budget: predicted experts are read there, outside the tier and its policy, and a
prediction that comes true moves into the tier as the demand miss it saved would have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from expertfs.errors import UsageError

from ..io import PAGE

__all__ = ["SlotGeometry", "Slots", "plan_slots", "WINDOW_BYTES", "WINDOW_ENV", "window_slots"]


@dataclass(frozen=True)
class SlotGeometry:
    """A store's routed experts as the tiers see them: which layers, how many experts each, the
    key stride and one slot's size (every slot holds the largest extent)."""

    layers: tuple[int, ...]              # store layers with routed experts, ascending
    experts: tuple[int, ...]             # experts of each of them
    n_experts: int                       # the widest layer: the key stride
    k: int                               # experts used per token (1 when the store does not say)
    slot_bytes: int                      # the largest extent
    stride: int                          # slot_bytes rounded up to the page
    drafts: tuple[int, ...] = ()         # NextN (MTP) blocks' layers: only drafts route there

    @property
    def routed(self) -> int:
        """Experts a decode step can route to: all but the NextN blocks'."""
        return sum(n for la, n in zip(self.layers, self.experts) if la not in self.drafts)

    @classmethod
    def from_store(cls, store: Any) -> SlotGeometry:
        layers = tuple(store.layers)
        if not layers:
            raise UsageError("the store has no routed experts", path=getattr(store, "path", None),
                             fix="a cache of experts needs an MoE model")
        experts = tuple(store.n_experts(la) for la in layers)
        summary = getattr(store, "summary", {}) or {}
        largest = 0
        drafts = []
        for la in layers:
            info = store.layer_info(la) if hasattr(store, "layer_info") else {}
            largest = max(largest, int(info.get("extent_bytes") or 0))
            if info.get("nextn"):
                drafts.append(la)
        if not largest:
            largest = max(store.extent(la, e).length for la, n in zip(layers, experts)
                          for e in range(n))
        k = int(summary.get("expert_used_count") or 1)
        return cls(layers, experts, max(experts), max(1, k), largest, -(-largest // PAGE) * PAGE,
                   tuple(drafts))

    def index_of(self) -> dict[int, int]:
        return {la: i for i, la in enumerate(self.layers)}

    def layer_of(self, key: int) -> int:
        """The layer *index* of a key (what per-layer policies are given)."""
        return key // self.n_experts


#: The spare slots' bytes a RAM tier of every expert keeps for the prompt window (``window``):
#: at least two layers' worth of routed experts (``2 k`` slots), at most one layer's every expert.
WINDOW_BYTES = 256 << 20


#: ``1`` asks for the prompt window (opt-in: it trades the decode's start for the first token,
#: bench/README.md "The prompt window"); else the prompt's experts are kept as it reads them.
WINDOW_ENV = "EXPERTFS_PROMPT_WINDOW"


def window_slots(slot_bytes: int, k: int, per_layer: int) -> int:
    """Spare slots for the prompt window of a tier with one slot per expert (``run``'s tier,
    ``plan``'s and the cache's alike; none unless ``WINDOW_ENV`` is ``1``)."""
    if slot_bytes <= 0 or per_layer <= 0 or os.environ.get(WINDOW_ENV, "0") != "1":
        return 0
    return min(per_layer, max(2 * k, WINDOW_BYTES // slot_bytes))


@dataclass(frozen=True)
class Slots:
    host: int            # host slots in the slab (the RAM budget)
    staging: int         # of which staging for demand reads (device tier only)
    ram: int             # host tier capacity given to its policy: host - staging
                         # (less the prompt window's spare slots: ``window``)
    vram: int            # device tier slots (0: no device tier)
    prefetch: int = 0    # host-only: slots predicted experts are read into (not the tier's)

    @property
    def compute(self) -> int:
        """Experts the tier the forward pass reads can hold at once."""
        return self.vram or self.ram


def plan_slots(geo: SlotGeometry, ram_bytes: int, vram_bytes: int, *, queue_depth: int,
               staging: int | None = None, prefetch: int = 0) -> Slots:
    """Slots for the budgets. ``staging`` (device tier only) defaults to min(queue depth, k) + 1;
    ``prefetch`` (no device tier only) is kept to at most half the host slots, leaving the
    tier at least k."""
    if ram_bytes < 0 or vram_bytes < 0:
        raise UsageError(f"negative cache budget (ram {ram_bytes}, vram {vram_bytes} bytes)",
                         fix="give budgets >= 0")
    host = ram_bytes // geo.stride
    vram = vram_bytes // geo.stride
    if vram_bytes and not vram:
        raise UsageError(f"a VRAM budget of {vram_bytes} bytes holds no expert (one slot is "
                         f"{geo.stride} bytes)", fix=f"give at least {geo.stride} bytes, or 0")
    if not host:
        raise UsageError(f"a RAM budget of {ram_bytes} bytes holds no expert (one slot is "
                         f"{geo.stride} bytes)",
                         fix=f"give at least {geo.stride} bytes"
                             + (" (reads are staged in RAM on their way to the device)" if vram else ""))
    total = sum(geo.experts)              # more slots than experts would never be used
    vram = min(vram, total)
    tier, name, have = (vram, "VRAM", vram_bytes) if vram else (min(host, total), "RAM", ram_bytes)
    if tier < min(geo.k, total):          # a decode step holds a layer's k experts at once
        raise UsageError(f"a {name} budget of {have} bytes holds {tier} "
                         f"expert{'' if tier == 1 else 's'}, and a token uses {geo.k} of a "
                         f"layer at once (one slot is {geo.stride} bytes)",
                         fix=f"give at least {geo.k * geo.stride} bytes"
                             + (", or 0" if vram else ""))
    if not vram:
        if host >= total:                 # every expert fits: nothing to predict; the spare
            spare = min(host - total, window_slots(geo.stride, geo.k, max(geo.experts)))
            return Slots(total + spare, 0, total, 0)      # slots are the prompt window's
        p = max(0, min(int(prefetch), host // 2, host - geo.k))
        return Slots(host, 0, host - p, 0, p)
    s = staging if staging is not None else min(queue_depth, geo.k) + 1
    s = max(1, min(s, host))
    ram = min(host - s, max(0, total - vram))
    host = ram + s
    if ram < geo.k:             # too small to be a tier: all of it stages reads
        s, ram = host, 0
    return Slots(host, s, ram, vram)
