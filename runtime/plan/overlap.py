"""The overlap of reads and compute that the CPU decode has by construction, priced at both
ends of ``plan``'s band (the fast end's rates and routing at the fast end), and the part of the
reads no overlap hides: the CPU they take from the cores that compute (``misses_cpu``).

A decode MoE layer on the CPU (``runtime.model.moe``, ``_overlapped``) issues the reads of its
missing experts, computes the experts already in RAM while they are read, then each missing one
as its read lands; the reads land one after another (``io.reader.READ_BYTES_IN_FLIGHT``). A
layer with ``m`` of its ``k`` experts missing, each read taking ``r`` and each product ``c``, is
a two-stage pipeline: the products end at ``max(k c, m r + c, r + m c)`` (all products, or the
last read and its product, or the first read and every product after it), so ``m r + k c``
minus that is overlapped; with no miss there is nothing to overlap. Both ends of the band count
this overlap, its expectation over the number of misses, each of the ``k`` experts missing
independently at that end's miss rate; only where the lookahead is on by default
(``lookahead_overlaps``: it reads layer L+1's predicted experts while layer L computes) does the
fast end overlap every read with the compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from typing import Any

from .geometry import Geometry
from .native import layer_cost, layer_key
from .rates import DeviceRates

__all__ = ["OVERLAP_DETAIL", "decode_overlap", "expected_overlap",
           "layer_overlap", "lookahead_overlaps", "token_overlap", "misses_cpu"]

#: the overlap term's detail, where a layer's misses are read once it is routed and (True)
#: where the lookahead reads ahead (``token_overlap``)
OVERLAP_DETAIL = {
    False: ("resident experts, and missing ones as they land, computed while a layer's other "
            "misses are read (the decode reads a layer's misses once it is routed)"),
    True: ("resident experts, and missing ones as they land, computed while a layer's other "
           "misses are read (the slow end); the lookahead, on by default for this architecture, "
           "reads the next layer's while this one computes (the fast end overlaps all)")}


def lookahead_overlaps(g: Geometry, mem: Any) -> bool:
    """Does ``run``'s decode read ahead of routing with the tiers of ``mem`` (``budget.Memory``)?
    Where its default lookahead (``prefetch.lookahead.auto_lookahead``, ``run``'s rule) is on;
    elsewhere it is off, or tried in decode and kept only when it measures faster, so a layer's
    misses are read once the layer is routed."""
    from ..prefetch.lookahead import auto_lookahead
    return auto_lookahead(g.arch, mem.ram.tier_slots, g.n_decode_experts,
                          bool(mem.vram and mem.vram.tier_slots), not mem.trunk_evicted) == "on"


def token_overlap(g: Geometry, mem: Any, rates: DeviceRates, routing: Any,
                  read_s: tuple[float, float], per_layer: bool) -> tuple[bool, float, float]:
    """(the lookahead reads ahead, the slow end's overlap, the fast end's) of a token whose
    expert reads take ``read_s`` (slow, fast end) at ``routing``'s (``predict.RoutingRange``)
    miss rates: a layer's misses are read once it is routed, so only they and its experts
    overlap (``decode_overlap``, per-layer native rates only); where the lookahead reads
    ahead by default (``lookahead_overlaps``) the fast end overlaps every read instead (0
    here: ``predict`` takes the larger of reads and compute)."""
    ahead = lookahead_overlaps(g, mem) or not per_layer
    ov = [decode_overlap(g, rates, routing.at(e).miss_rate, r, e) if per_layer else 0.0
          for e, r in zip(("slow", "fast"), read_s)]
    return ahead, ov[0], 0.0 if ahead else ov[1]


def misses_cpu(routing: Any, rates: Any) -> tuple[float, float, str]:
    """The CPU a token's expert reads (``routing``'s NVMe bytes, slow and fast end) take from
    the cores the decode computes on, the ``read_cpu`` term: the reads' own (``Rates.miss_cpu``,
    system calls, completions, the I/O threads' wake-ups) and, at the slow end, the checksums
    of an expert's first read in a process (``Rates.verify``: a short run's misses are mostly
    first reads; a long run's are re-reads, unchecked)."""
    check = rates.verify.slow if rates.verify is not None else 0.0
    miss_bytes = [routing.at(e).nvme_bytes_per_token for e in ("slow", "fast")]
    slow = miss_bytes[0] / 1e9 * (rates.miss_cpu.slow + check)
    fast = miss_bytes[1] / 1e9 * rates.miss_cpu.fast
    return slow, fast, (f"{miss_bytes[0] / 2**20:.0f} MiB/token of reads at "
                        f"{rates.miss_cpu.fast:.2f}-{rates.miss_cpu.slow:.2f} CPU s/GB"
                        + (f" + {check:.2f} of first-read checksums (slow end)" if check else ""))


def decode_overlap(g: Geometry, rates: DeviceRates, miss_rate: float, read_s: float,
                   end: str = "slow") -> float:
    """The overlap of a token on the CPU at ``end`` of the band: ``read_s`` of expert reads at
    ``miss_rate``, with each layer's k experts at the native layer rate of ``rates``; none
    where a layer has no native kernel (the torch path computes after all its reads)."""
    if not all(layer_key(parts, g.k) in rates.layers for parts in g.expert_parts):
        return 0.0
    return expected_overlap(g.k, miss_rate, read_s,
                            [layer_cost(rates, parts, g.k, end) for parts in g.expert_parts])


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
