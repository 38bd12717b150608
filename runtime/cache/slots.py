"""Fixed-size expert slots carved from one slab, with a free list and a fence per slot.

Every slot holds one expert whatever its size: the slot is the store's largest extent, rounded
up to the page, so any expert fits any slot and a tier is a plain array of slots (no
fragmentation, no allocator in the hot path). The host slab comes from
:class:`expertfs.runtime.io.HostSlab` (page-aligned for O_DIRECT, pinned with cudaHostRegister
when CUDA is present, as many slots as the :class:`PinBudget` allows, the rest pageable; free
pinned slots are handed out first); the
device slab is one ``torch.empty`` on the CUDA device, or a page-aligned CPU slab when the
"device" is the CPU.

A RAM tier with a slot for every expert may instead be the experts file itself
(:class:`MappedPool`, ``host_tier``): nothing is ever evicted from such a tier, so each expert
keeps its place in the file, read into the page cache by faulting its range in.

``fence[i]`` is what the next *writer* of slot ``i`` must wait for. Host slots: the last
asynchronous copy that read or wrote them (storage reads sync on it; copies on the copy stream
are ordered anyway). Device slots: the compute stream's mark at the release of the last layer
that read them (copies wait on it on the GPU).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from expertfs.errors import UsageError
from expertfs.store.layout import Extent

from ..experts.protocol import QWeight, weights_from_buffer
from ..io import PAGE, HostSlab, PinBudget, aligned_empty
from ..io.mapped import page_cache_share, populate_supported
from .copier import Fence, host_wait
from .vram import device_memory

__all__ = ["MAPPED_WHEN_CACHED", "RAM_TIERS", "SlotPool", "MappedPool", "host_tier", "maps_tier"]

#: What ``host_tier`` may build the RAM tier as (``ram_tier``).
RAM_TIERS = ("auto", "mapped", "slab")


class SlotPool:
    kind = "slab"                 # what ``describe`` calls the RAM tier (``MappedPool``: mapped)

    def __init__(self, name: str, n_slots: int, slot_bytes: int, *, device: torch.device,
                 host: bool, pin: bool | str = "auto", pin_budget: PinBudget | None = None,
                 alignment: int = PAGE, prefault: bool = True) -> None:
        if n_slots < 1 or slot_bytes < 1:
            raise UsageError(f"{name} tier: {n_slots} slots of {slot_bytes} bytes",
                             fix="give the tier a budget of at least one slot")
        self.name = name
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.stride = -(-slot_bytes // alignment) * alignment
        self.device = device
        self._slab: HostSlab | None = None
        if host:
            self._slab = HostSlab(n_slots, slot_bytes, pin=pin, budget=pin_budget,
                                  alignment=alignment, prefault=prefault)
            self.tensor = self._slab.tensor
            self.pinned, self.pin_note = self._slab.pinned, self._slab.pin_note
            self.pinned_slots = self._slab.pinned_slots
        else:
            n = n_slots * self.stride
            if device.type == "cuda":
                with device_memory(f"the {name} tier's slab of {n_slots} expert slots",
                                   nbytes=n, fix="give a smaller --vram (or --vram 0)"):
                    self.tensor = torch.empty(n, dtype=torch.uint8, device=device)
            else:
                self.tensor = aligned_empty(n, alignment=alignment)
            self.pinned, self.pin_note, self.pinned_slots = False, "device memory", 0
        st = self.stride
        self._views = [self.tensor[i * st:i * st + slot_bytes] for i in range(n_slots)]
        # FIFO each (the longest free, whose copies are done); pinned slots first, so staging
        # reads and uploads go through page-locked memory whenever a pinned slot is free
        self._free = deque(range(self.pinned_slots))
        self._free_pageable = deque(range(self.pinned_slots, n_slots))
        self.fence: list[Fence] = [None] * n_slots
        self.base = self.tensor.data_ptr()
        self._parts: dict[tuple[int, int], Mapping[Any, QWeight]] = {}

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.stride

    @property
    def n_free(self) -> int:
        return len(self._free) + len(self._free_pageable)

    @property
    def pinned_bytes(self) -> int:
        return self.pinned_slots * self.stride

    def view(self, i: int) -> torch.Tensor:
        """Slot ``i`` as a flat uint8 tensor of ``slot_bytes`` (a view into the slab)."""
        return self._views[i]

    def address(self, i: int) -> int:
        return self.base + i * self.stride

    def parts(self, i: int, layout: int, extent: Extent) -> Mapping[Any, QWeight]:
        """``QWeight`` views of an expert with ``extent``'s layout (``layout`` names it) in slot
        ``i``, made once per slot and layout and kept: creating and freeing tensor views is
        cheap alone but not while I/O threads are busy, so the hot path does neither."""
        key = (i, layout)
        parts = self._parts.get(key)
        if parts is None:
            parts = self._parts[key] = MappingProxyType(
                dict(weights_from_buffer(extent, self._views[i]).parts))
        return parts

    def rows(self) -> torch.Tensor:
        """The slab as ``[n_slots, stride]`` uint8, for kernels that gather by slot id."""
        return self.tensor[:self.n_slots * self.stride].view(self.n_slots, self.stride)

    def alloc(self, *, host_write: bool, key: int | None = None) -> int | None:
        """A free slot, or None. ``host_write``: the caller writes it from the host (a storage
        read), so any asynchronous copy still touching it is waited for first. ``key`` (the
        expert's) matters only to a ``MappedPool``."""
        if self._free:
            i = self._free.popleft()
        elif self._free_pageable:
            i = self._free_pageable.popleft()
        else:
            return None
        if host_write and self.fence[i] is not None:
            host_wait(self.fence[i])
            self.fence[i] = None
        return i

    def free(self, i: int, fence: Fence = None) -> None:
        if fence is not None:
            self.fence[i] = fence
        (self._free if i < self.pinned_slots else self._free_pageable).append(i)

    def close(self) -> None:
        if self._slab is not None:
            self._slab.close()
        self._free, self._free_pageable = deque(), deque()
        self._views = []
        self._parts = {}


class MappedPool(SlotPool):
    """The host tier as the experts file itself (``io.FileMapping``): one slot per expert key,
    each the view of that expert's extent where the file holds it, filled by faulting the range
    in through the page cache (the reader sees the view is the file's own bytes) rather than
    by a read into anonymous memory. For a tier that holds every expert a decode step routes
    to (``host_tier``) on a CPU compute device (pages of the page cache are not page-locked for
    uploads): every key keeps its own slot, so an expert the policy drops (a NextN block's,
    which only drafts ask for) is simply faulted in again when asked for. ``extents[key]`` is
    the key's extent, None for a key with no expert (a layer with fewer experts than the
    widest)."""

    kind = "mapped"

    def __init__(self, name: str, mapping: Any, extents: list[Extent | None],
                 slot_bytes: int) -> None:
        self.name = name
        self.n_slots = len(extents)
        self.slot_bytes = slot_bytes
        self.stride = -(-slot_bytes // PAGE) * PAGE
        self.device = torch.device("cpu")
        self._slab = None
        self._mapping = mapping
        self.tensor = mapping.tensor
        self.pinned, self.pin_note, self.pinned_slots = False, "mapped (the page cache)", 0
        empty = self.tensor[:0]
        self._views = [empty if x is None else mapping.view(x.offset, x.length) for x in extents]
        self._unused = {k for k, x in enumerate(extents) if x is not None}   # keys not taken
        self.fence = [None] * self.n_slots
        self.base = self.tensor.data_ptr()
        self._parts = {}

    @property
    def nbytes(self) -> int:
        return sum(int(v.numel()) for v in self._views)

    @property
    def n_free(self) -> int:
        return len(self._unused)

    def address(self, i: int) -> int:
        return self._views[i].data_ptr()

    def rows(self) -> torch.Tensor:
        raise UsageError("a mapped RAM tier has no uniform slot rows: each expert sits at its "
                         "offset in the experts file", fix="gather by slot with view(i)")

    def alloc(self, *, host_write: bool, key: int | None = None) -> int | None:
        """``key``'s own slot (its extent in the file), or None when it is taken or absent."""
        if key is None or key not in self._unused:
            return None
        self._unused.discard(key)
        return key

    def free(self, i: int, fence: Fence = None) -> None:
        self._unused.add(i)

    def close(self) -> None:
        self._unused = set()
        self._views = []
        self._parts = {}
        self.tensor = None
        self._mapping = None


#: The share of the experts file the page cache must hold for ``auto`` to map it.
MAPPED_WHEN_CACHED = 0.5


def maps_tier(ram_tier: str, *, fits: bool, cuda: bool, alone: bool, auto_backend: bool,
              cached: Callable[[], float]) -> bool:
    """Whether ``host_tier`` makes the RAM tier the mapped experts file (the rule below);
    ``cached()``: the share of the file the page cache holds now, asked only where it decides.
    ``expertfs plan`` asks the same for the run it recommends (``plan.coldstart``)."""
    if ram_tier not in RAM_TIERS:
        raise UsageError(f"ram_tier={ram_tier!r} is not one of {', '.join(RAM_TIERS)}",
                         fix="use auto (the default), mapped or slab")
    if ram_tier == "slab" or not fits or cuda or not alone or not populate_supported():
        return False
    if ram_tier == "mapped":
        return True
    return auto_backend and os.environ.get("EXPERTFS_MAPPED_TIER", "1") != "0" \
        and cached() >= MAPPED_WHEN_CACHED


def host_tier(geo: Any, reader: Any, n_slots: int, *, cuda: bool, alone: bool,
              pin: bool | str, pin_budget: PinBudget | None, ram_tier: str = "auto"
              ) -> SlotPool:
    """The RAM tier's pool: a ``MappedPool`` over the experts file, or a slab.

    ``ram_tier="mapped"`` maps where it can: the tier has a slot for every expert a decode step
    can route to (``geo.routed``: a NextN block's experts, which only drafts route to, are
    mapped too, but ``run`` leaves them out of the tier it sizes), the compute
    device is the CPU, the tier is ``alone`` (no device tier, no prefetch staged outside it) and
    the kernel can fault a file range in. ``"auto"`` (the default) maps there too when the page
    cache already holds at least ``MAPPED_WHEN_CACHED`` of the file (as an earlier mapped run, a
    copy or another reader leaves it: its experts are then mapped with no read at all, where the
    slab would read them all again into memory taken from that page cache), the reader's
    backend was picked by ``auto`` (a backend asked for by name reads into a slab, as asked) and
    ``EXPERTFS_MAPPED_TIER`` is not ``0``; a cold start reads into the slab, O_DIRECT: mapped,
    the GLM-5.3 cut's cold and warm runs were slower to the first token and in decode, most
    likely the warm start's page-cache reads taking the decode's cores (bench/README.md "The
    mapped RAM tier"). ``"slab"`` never maps.

    A slab is faulted in ahead of the reads (``HostSlab``'s prefault) only where the reads will
    cycle through it (a cap): a tier with a slot for every expert is filled by the prompt's
    reads, a part of it, then the warm start's, and faulting in the rest ahead takes the
    prompt's CPU (the uncapped first token, bench/README.md "fault-in")."""
    every = n_slots >= sum(geo.experts)
    mapping = None
    if maps_tier(ram_tier, fits=n_slots >= geo.routed, cuda=cuda, alone=alone,
                 auto_backend=reader.handle.choice is not None,
                 cached=lambda: page_cache_share(reader.path)):
        mapping = reader.map_file()
    if mapping is not None:
        E = geo.n_experts
        extents = [reader.extent(layer, ex) if ex < geo.experts[li] else None
                   for li, layer in enumerate(geo.layers) for ex in range(E)]
        return MappedPool("ram", mapping, extents, geo.slot_bytes)
    return SlotPool("ram", n_slots, geo.slot_bytes, device=torch.device("cpu"), host=True,
                    pin=pin if cuda else False, pin_budget=pin_budget, prefault=not every)
