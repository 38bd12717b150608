"""The slot table: (layer, expert) → slot of the compute tier, on the compute device.

``device[layer_index, expert]`` is an int32 tensor on the compute device holding the slot of
every expert resident in the tier the forward pass reads (the device tier, or the host tier on a
CPU-only run), -1 for the others. A CUDA forward pass can map its router's top-k ids to slots
and gather weights from the slab without a sync to the host. ``host`` is the mechanism's mirror
(numpy, updated at once). On CPU both are one array.

On a device the table is never written element by element (an indexing assignment from a
Python scalar is a blocking host-to-device copy: every upload would synchronise the copy
stream). Updates are collected on the host and written by :meth:`flush` as one batch: one small
host buffer (pinned on CUDA), one ``non_blocking`` copy and one ``index_copy_``, queued on the
current stream. ``set_now`` flushes (call it from the copy stream, after the upload of the
expert and before the upload's event: ``Copier.copy(then=...)``); ``clear`` only records, so
the -1 reaches the device with the write into the freed slot (``clear(..., slot=)``; without a
slot, with the next flush), which the copy stream queues after it waited on that slot's fence:
a kernel still reading the victim's row before its release sees its slot until it is done,
even when other uploads (into other slots) are queued between the eviction and the freed
slot's own upload.
"""

from __future__ import annotations

import numpy as np
import torch

from .copier import Copier

__all__ = ["SlotTable"]


class SlotTable:
    def __init__(self, n_layers: int, n_experts: int, device: torch.device, copier: Copier,
                 *, mirror: bool = False) -> None:
        """``mirror``: keep a separate device copy even on a non-CUDA device (tests)."""
        self.host = np.full((n_layers, n_experts), -1, dtype=np.int32)
        self.copier = copier
        self._E = n_experts
        self._pending: dict[int, int] = {}      # flat index -> slot, not yet on the device
        self._cleared: dict[int, int] = {}      # freed slot -> flat index cleared with its write
        self._pin = device.type == "cuda"
        self.writes = 0                         # batches written to the device copy
        if device.type == "cpu" and not mirror:
            self.device = torch.from_numpy(self.host)
            self._shared = True
            return
        self.device = torch.full((n_layers, n_experts), -1, dtype=torch.int32, device=device)
        self._shared = False
        if device.type == "cuda":
            # the fill above runs on the current stream; later writes run on the copy stream
            copier.stream.wait_stream(torch.cuda.current_stream(device))

    @property
    def pending(self) -> int:
        """Updates recorded on the host and not yet written to the device copy."""
        return len(self._pending) + len(self._cleared)

    def lookup(self, layer_index: int, expert: int) -> int:
        return int(self.host[layer_index, expert])

    def row(self, layer_index: int) -> torch.Tensor:
        """The device row of one layer: ``row[expert]`` is a slot or -1."""
        return self.device[layer_index]

    def set_now(self, layer_index: int, expert: int, slot: int) -> None:
        """Write both copies (with any pending clears); on a device the write is queued on the
        current stream, so call it from the copy stream (``Copier.copy(then=...)``)."""
        self.host[layer_index, expert] = slot
        if not self._shared:
            flat = layer_index * self._E + expert
            for s, f in [kv for kv in self._cleared.items() if kv[1] == flat]:
                del self._cleared[s]            # back before its old slot was written
            f = self._cleared.pop(int(slot), None)
            if f is not None:
                self._pending[f] = -1
            self._pending[flat] = int(slot)
            self.flush()

    def clear(self, layer_index: int, expert: int, *, slot: int | None = None) -> None:
        """Mark an expert absent: at once on the host; on the device with the write into
        ``slot`` (its freed slot: that upload's copy waited on the slot's fence), or with the
        next flush when no slot is given."""
        if self.host[layer_index, expert] < 0:
            return
        self.host[layer_index, expert] = -1
        if not self._shared:
            flat = layer_index * self._E + expert
            if slot is None:
                self._pending[flat] = -1
            else:
                self._cleared[int(slot)] = flat

    def flush(self) -> None:
        """Write the pending updates to the device copy on the current stream: one host buffer,
        one non-blocking copy, one ``index_copy_``; the host never waits."""
        if self._shared or not self._pending:
            return
        n = len(self._pending)
        arr = np.empty(2 * n, dtype=np.int32)
        arr[:n] = np.fromiter(self._pending.keys(), dtype=np.int32, count=n)
        arr[n:] = np.fromiter(self._pending.values(), dtype=np.int32, count=n)
        self._pending.clear()
        self._write(torch.from_numpy(arr))
        self.writes += 1

    def _write(self, batch: torch.Tensor) -> None:
        """``batch``: n flat indices then their n slots (int32, host)."""
        n = batch.numel() // 2
        if self._pin:
            # the caching host allocator keeps a pinned block until the copies that read it ran
            batch = batch.pin_memory()
        d = batch.to(self.device, non_blocking=True)
        self.device.view(-1).index_copy_(0, d[:n].long(), d[n:])
