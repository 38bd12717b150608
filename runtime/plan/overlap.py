"""The overlap of reads and compute that the CPU decode has by construction, priced for the
slow end of ``plan``'s band.

A decode MoE layer on the CPU (``runtime.model.moe``, ``_overlapped``) issues the reads of its
missing experts, computes the experts already in RAM while they are read, then each missing one
as its read lands; the reads land one after another (``io.reader.READ_BYTES_IN_FLIGHT``). A
layer with ``m`` of its ``k`` experts missing, each read taking ``r`` and each product ``c``, is
a two-stage pipeline: the products end at ``max(k c, m r + c, r + m c)`` (all products, or the
last read and its product, or the first read and every product after it), so ``m r + k c``
minus that is overlapped; with no miss there is nothing to overlap. The slow end of the band
counts only this overlap (not the predictors' prefetch, which may overlap more or read for
nothing): its expectation over the number of misses, each of the ``k`` experts missing
independently at the slow end's miss rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

from .geometry import Geometry
from .native import layer_cost, layer_key
from .rates import DeviceRates

__all__ = ["OVERLAP_DETAIL", "decode_overlap", "expected_overlap", "layer_overlap"]

OVERLAP_DETAIL = ("resident experts, and missing ones as they land, computed while a layer's "
                  "other misses are read (the slow end's only overlap; the fast end overlaps all)")


def decode_overlap(g: Geometry, rates: DeviceRates, miss_rate: float, read_s: float) -> float:
    """The slow end's overlap of a token on the CPU: ``read_s`` of expert reads at
    ``miss_rate``, with each layer's k experts at the native layer rate of ``rates``; none
    where a layer has no native kernel (the torch path computes after all its reads)."""
    if not all(layer_key(parts, g.k) in rates.layers for parts in g.expert_parts):
        return 0.0
    return expected_overlap(g.k, miss_rate, read_s,
                            [layer_cost(rates, parts, g.k, "slow") for parts in g.expert_parts])


def layer_overlap(k: int, m: int, read: float, compute: float) -> float:
    """Seconds one layer's reads and products overlap: ``m`` of its ``k`` experts read one after
    another (``read`` each), every product ``compute``, the resident ones first and each missing
    one once its read has landed."""
    if m <= 0:
        return 0.0
    end = max(k * compute, m * read + compute, read + m * compute)
    return m * read + k * compute - end


def expected_overlap(k: int, miss_rate: float, read_s: float, compute_s: Sequence[float]) -> float:
    """Seconds a token of reads and products overlap: ``read_s`` the token's expert reads (all
    layers), ``compute_s`` each MoE layer's k routed experts' product time, ``miss_rate`` the
    share of routed experts read from storage. The reads are spread over the layers by their
    misses (``read_s / (layers * k * miss_rate)`` per missing expert)."""
    n = len(compute_s)
    if k < 2 or n == 0 or read_s <= 0 or not 0 < miss_rate <= 1:
        return 0.0
    per_miss = read_s / (n * k * miss_rate)
    probs = [comb(k, m) * miss_rate ** m * (1 - miss_rate) ** (k - m) for m in range(1, k + 1)]
    return sum(p * layer_overlap(k, m, per_miss, layer_s / k)
               for layer_s in compute_s for m, p in zip(range(1, k + 1), probs))
