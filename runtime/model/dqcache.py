"""A byte-budgeted LRU of experts already dequantized into the compute dtype.

Where experts are multiplied as floats (the GPU, ``--fused off``, a type without a native
product), dequantizing an expert's ggml bytes costs far more than multiplying by it, so when
memory allows, experts are kept as float ``[out, in]`` matrices keyed by ``(layer, expert)``: a
hit skips both the provider and the dequantization. The cache is an extra, opt-in tier above
the provider's quantized tiers; its budget counts float bytes (bf16: ~3.6× the Q4_K size,
float32: ~7×). ``budget=0`` disables it, and ``dequant_cache`` does on the CPU where the native
kernels take every expert type (their products from the blocks beat dequantized floats).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from ...formats.ggml import GGMLType
from .ffn import FloatExpert

__all__ = ["DequantCache", "dequant_cache"]

log = logging.getLogger(__name__)


class DequantCache:
    def __init__(self, budget: int) -> None:
        self.budget = max(0, int(budget))
        self.used = 0
        self.hits = self.misses = self.evictions = 0
        self._d: OrderedDict[tuple[int, int], FloatExpert] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def get(self, layer: int, expert: int) -> FloatExpert | None:
        e = self._d.get((layer, expert))
        if e is None:
            self.misses += 1
            return None
        self._d.move_to_end((layer, expert))
        self.hits += 1
        return e

    def put(self, layer: int, expert: int, e: FloatExpert) -> bool:
        """Insert ``e``, evicting least recently used experts; False if it can never fit."""
        if e.nbytes > self.budget:
            return False
        key = (layer, expert)
        old = self._d.pop(key, None)
        if old is not None:
            self.used -= old.nbytes
        while self._d and self.used + e.nbytes > self.budget:
            _, ev = self._d.popitem(last=False)
            self.used -= ev.nbytes
            self.evictions += 1
        self._d[key] = e
        self.used += e.nbytes
        return True

    def __contains__(self, key: tuple[int, int]) -> bool:
        """Is ``(layer, expert)`` kept (without counting a use)?"""
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        self._d.clear()
        self.used = 0

    def stats(self) -> dict[str, int]:
        return {"budget": self.budget, "used": self.used, "experts": len(self._d),
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


def dequant_cache(store: Any, nbytes: int, fused: bool, device: str) -> DequantCache:
    """The cache of ``nbytes`` for ``store`` on ``device``, or none on the CPU where the native
    kernels multiply every expert type of the store from its blocks (slower as dequantized
    floats there, and 4-8x the bytes)."""
    return DequantCache(_budget(store, nbytes, fused, device))


def _budget(store: Any, nbytes: int, fused: bool, device: str) -> int:
    if not nbytes or not fused or device != "cpu":
        return nbytes
    from .. import kernels
    types = {p["type"] for la in store.layers for p in store.layer_info(la)["parts"]}
    if kernels.available() and all(int(GGMLType[t]) in kernels.TYPES for t in types):
        log.warning("--dq-cache not used: the native kernels multiply every expert type here "
                    "(%s) from its blocks, faster than dequantized floats",
                    ", ".join(sorted(types)))
        return 0
    return nbytes
