"""Fixed-size expert slots carved from one slab, with a free list and a fence per slot.

Every slot holds one expert whatever its size: the slot is the store's largest extent, rounded
up to the page, so any expert fits any slot and a tier is a plain array of slots (no
fragmentation, no allocator in the hot path). The host slab comes from
:class:`expertfs.runtime.io.HostSlab` (page-aligned for O_DIRECT, pinned with cudaHostRegister
when CUDA is present, as many slots as the :class:`PinBudget` allows, the rest pageable; free
pinned slots are handed out first); the
device slab is one ``torch.empty`` on the CUDA device, or a page-aligned CPU slab when the
"device" is the CPU.

``fence[i]`` is what the next *writer* of slot ``i`` must wait for. Host slots: the last
asynchronous copy that read or wrote them (storage reads sync on it; copies on the copy stream
are ordered anyway). Device slots: the compute stream's mark at the release of the last layer
that read them (copies wait on it on the GPU).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from expertfs.errors import UsageError
from expertfs.store.layout import Extent

from ..experts.protocol import QWeight, weights_from_buffer
from ..io import PAGE, HostSlab, PinBudget, aligned_empty
from .copier import Fence, host_wait
from .vram import device_memory

__all__ = ["SlotPool"]


class SlotPool:
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

    def alloc(self, *, host_write: bool) -> int | None:
        """A free slot, or None. ``host_write``: the caller writes it from the host (a storage
        read), so any asynchronous copy still touching it is waited for first."""
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
