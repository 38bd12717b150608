"""The slot table: (layer, expert) → slot of the compute tier, on the compute device.

``device[layer_index, expert]`` is an int32 tensor on the compute device holding the slot of
every expert resident in the tier the forward pass reads (the device tier, or the host tier on a
CPU-only run), -1 for the others. A CUDA forward pass can map its router's top-k ids to slots
and gather weights from the slab without a sync to the host. ``host`` is the mechanism's mirror
(numpy, updated at once). On CUDA the device copy is written on the copy stream, in order with
the uploads: a set is queued after the upload of the expert and before the upload's event, so
a compute stream that waited on that event sees it; a clear is queued before anything else
is written into the freed slot. On CPU both are one array.
"""

from __future__ import annotations

import numpy as np
import torch

from .copier import Copier

__all__ = ["SlotTable"]


class SlotTable:
    def __init__(self, n_layers: int, n_experts: int, device: torch.device, copier: Copier) -> None:
        self.host = np.full((n_layers, n_experts), -1, dtype=np.int32)
        self.copier = copier
        if device.type == "cuda":
            self.device = torch.full((n_layers, n_experts), -1, dtype=torch.int32, device=device)
            # the fill above runs on the current stream; later writes run on the copy stream
            copier.stream.wait_stream(torch.cuda.current_stream(device))
            self._shared = False
        else:
            self.device = torch.from_numpy(self.host)
            self._shared = True

    def lookup(self, layer_index: int, expert: int) -> int:
        return int(self.host[layer_index, expert])

    def row(self, layer_index: int) -> torch.Tensor:
        """The device row of one layer: ``row[expert]`` is a slot or -1."""
        return self.device[layer_index]

    def set_now(self, layer_index: int, expert: int, slot: int) -> None:
        """Write both copies; on CUDA the device write is queued on the current stream, so call
        it from the copy stream (``Copier.copy(then=...)`` or ``Copier.on_stream``)."""
        self.host[layer_index, expert] = slot
        if not self._shared:
            self.device[layer_index, expert] = slot

    def clear(self, layer_index: int, expert: int) -> None:
        """Mark an expert absent, ordered before later copies on the copy stream."""
        if self.host[layer_index, expert] < 0:
            return
        self.host[layer_index, expert] = -1
        if not self._shared:
            self.copier.on_stream(lambda: self.device[layer_index, expert].fill_(-1))
