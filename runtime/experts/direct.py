"""The reference provider: every ``get`` reads its experts from the store, nothing is cached.

Simple on purpose: it is the correctness baseline for the tiered provider and what tests use
when caching is not the subject. Reads go through the I/O engine with checksums on first read.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from ..io import ExpertReader, aligned_empty
from .protocol import ExpertProvider, ExpertWeights, ProviderStats, weights_from_buffer

__all__ = ["DirectProvider"]


class DirectProvider(ExpertProvider):
    """The contract and no optional capability: no tier, no warm start, no prefetch."""

    def __init__(self, store: Any, device: str | torch.device = "cpu", backend: str = "buffered",
                 queue_depth: int = 8) -> None:
        self.store = store
        self.device = torch.device(device)
        self.reader = ExpertReader(store, backend=backend, queue_depth=queue_depth)
        self.stats = ProviderStats()
        self._held: dict[int, list[torch.Tensor]] = {}

    def get(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        t0 = time.perf_counter()
        futs = []
        for e in experts:
            ext = self.store.extent(layer, e)
            buf = aligned_empty(ext.length)
            futs.append((ext, buf, self.reader.read_expert(layer, e, into=buf)))
        out = {}
        held = self._held.setdefault(layer, [])
        for ext, buf, fut in futs:
            fut.result()
            t = buf if self.device.type == "cpu" else buf.to(self.device, non_blocking=False)
            held.append(t)
            out[ext.expert] = weights_from_buffer(ext, t)
            self.stats.bytes_read += ext.length
        self.stats.requests += len(experts)
        self.stats.misses += len(experts)
        self.stats.stall_seconds += time.perf_counter() - t0
        return out

    def release(self, layer: int) -> None:
        self._held.pop(layer, None)

    def prefetch(self, layer: int, experts: Sequence[int], source: str = "gate") -> None:
        return None

    def close(self) -> None:
        self._held.clear()
        self.reader.close()
