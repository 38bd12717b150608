"""``expertfs plan``'s first token: the prompt's prefill, predicted apart from decode.

``expertfs run`` feeds a prompt of P tokens in batches of ``--batch`` (256) tokens. In one batch
every decoder layer streams each trunk matrix once and each expert its tokens route to once
and does 2 · tokens · weights floating-point operations. Up to a type's native token limit a
product unpacks each weight once (at the decode kernels' rate, ``Rates.cpu``) and its
arithmetic runs at the box's float32 matrix-multiply rate (``gemm_rate``: measured, or
``STATED_GEMM_GFLOPS`` per core). Past it, as ``run`` does (``WidePath``): the panel product
at its measured rate, its dequantization included (``kernels.qgemm``), or where the kernels
have none, the matrix dequantized whole at the native dequantization rate and multiplied at
the float32 rate. The output head runs for the last token only. Where a cap evicts part of the
trunk each batch reads ``TRUNK_REREAD`` times that again. The tiers start cold (the
warm start waits for the first logits), so every expert the batch touches is read from the
drive unless an earlier batch left it in the tier.

Experts touched per layer by b tokens: where the store's runs counted how much of a layer
their prompts touched (``plan.routing.learned_coverage``), that at both ends; else at the fast
end what the routing replay (the trace, else the fast synthetic preset) touches in its first b
tokens; at the slow end the same from ``slow_replay`` where the routing was measured (this
store's trace or its learned usage), else as if routing were uniform and independent,
``E · (1 − (1 − k/E)^b)`` (a balanced model's most).
Slow end: compute + reads (nothing overlapped); fast end: the rest of the compute + max(the
experts' products, reads), as the engine computes a layer's experts already in while the rest
are read, and its attention and trunk products only once the layer's experts are done (the
next layer's reads start after its routing: ``--prefill-prefetch`` is off by default). Both ends add to the compute the CPU
the reads take (``Rates.read_cpu``, at that end) for the bytes read into the tiers' fresh
pages, up to the tiers' size: whether the runtime's background fault-in or the read touches a
fresh page first, that touch is CPU time on the cores the prompt computes on (on a virtual
machine, most of an uncapped full-depth prompt's time, bench/README.md), and the checksums of
every expert the prompt loads, read or mapped, once each (``Rates.verify``). Where ``run`` maps
its RAM tier, the drive reads only the share of them the page cache lacks
(``coldstart.drive_share``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from .coldstart import distinct_experts
from .geometry import Geometry, Matrix
from .host import PREFILL_BATCH
from .native import compute_cost
from .rates import Range, Rates

__all__ = ["FirstToken", "WidePath", "first_token", "gemm_rate", "touched_per_layer",
           "STATED_GEMM_GFLOPS", "PREFILL_BATCH"]

#: float32 matrix-multiply GFLOP/s per core assumed without a probe (AVX2 at one to two FMA
#: ports' worth of a 3 GHz core, less what BLAS loses at the batch sizes of a prefill)
STATED_GEMM_GFLOPS = (25.0, 50.0)


class WidePath(NamedTuple):
    """How ``run`` multiplies one ggml type's trunk matrix by more tokens than its native
    kernels take (``model.wide.wide_linear``)."""

    limit: int                   # the most tokens a native product takes
    panel: Range | None = None   # GFLOP/s of the panel product (``kernels.qgemm``), if any
    dequant: Range | None = None  # G weights/s of the dequantization BLAS's product starts with

    def seconds(self, elements: float, tokens: int, gemm: Range, end: str) -> float | None:
        """The product's time at ``end``, or None where neither path has a figure."""
        flops = 2.0 * tokens * elements
        if self.panel is not None:
            return flops / (self.panel.at(end) * 1e9)
        if self.dequant is not None:
            return elements / (self.dequant.at(end) * 1e9) + flops / (gemm.at(end) * 1e9)
        return None


@dataclass(frozen=True)
class FirstToken:
    """Seconds to the first token of a ``prompt_tokens`` prompt (slow, fast end) and its parts."""

    prompt_tokens: int
    s_slow: float
    s_fast: float
    compute_s: tuple[float, float]
    read_bytes: tuple[float, float]
    gemm_gflops: Range
    fresh_s: tuple[float, float] = (0.0, 0.0)   # CPU of reads into the tiers' fresh pages
    drive: float = 1.0           # share of the experts read from the drive (the rest mapped
                                 # from the page cache: ``coldstart.drive_share``)
    verify_s: tuple[float, float] = (0.0, 0.0)  # CPU of the experts' checksums on first read
    cover: str = ""              # where the experts a batch touches come from, when learned
    experts_s: tuple[float, float] = (0.0, 0.0)  # the routed experts' part of compute_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gemm_gflops"] = self.gemm_gflops.as_dict()
        return d


def gemm_rate(probe: bool = True) -> Range:
    """This box's float32 GFLOP/s on torch's threads through the GEMM library the runtime uses
    (``kernels.gemm.linear``; [128, 2048] × [2048, 2048]ᵀ, best of five; the slow end 0.7 of it),
    or the stated per-core default."""
    cores = os.cpu_count() or 1
    if probe:
        try:
            import torch

            from ..kernels import gemm
            x, w = torch.randn(128, 2048), torch.randn(2048, 2048)
            gemm.linear(x, w)
            best = math.inf
            for _ in range(5):
                t0 = time.perf_counter()
                gemm.linear(x, w)
                best = min(best, time.perf_counter() - t0)
            g = 2 * 128 * 2048 * 2048 / best / 1e9
            return Range(0.7 * g, g, f"measured now: float32 {gemm.backend()}, "
                                     f"{torch.get_num_threads()} threads (slow end 0.7x)")
        except ImportError:
            pass
    lo, hi = STATED_GEMM_GFLOPS
    return Range(lo * cores, hi * cores, f"stated default: {lo:g}-{hi:g} GFLOP/s per core")


def touched_per_layer(g: Geometry, tokens: int, replay: Any = None, coverage: Any = None
                      ) -> float:
    """Distinct experts ``tokens`` tokens touch in one MoE layer: what the store's earlier
    prompts touched at that length (``coverage``: ``plan.routing.Coverage``) where they were
    counted, else the replay's first ``tokens`` tokens (scaled by the uniform growth where the
    replay is shorter), else uniform and independent routing."""
    if coverage is not None:
        return coverage.touched(tokens)

    def uniform(b: int) -> float:
        return distinct_experts(g.n_experts, g.k, b)

    if replay is None or not replay.rows or not g.moe_layers:
        return uniform(tokens)
    n = min(tokens, replay.n_tokens)
    first = replay.clock[0] if replay.clock else 0
    keys = {key for row, t in zip(replay.rows, replay.clock) if t - first < n for key in row}
    per_layer = len(keys) / len(g.moe_layers)
    return per_layer * uniform(tokens) / uniform(n) if n < tokens and uniform(n) else per_layer


def first_token(g: Geometry, rates: Rates, tier_slots: int, prompt_tokens: int,
                gemm: Range, replay: Any = None, batch: int = PREFILL_BATCH,
                wide: Mapping[str, WidePath] | None = None,
                slow_replay: Any = None, trunk_reread: tuple[int, int] = (0, 0),
                drive: float = 1.0, verify: Range | None = None,
                fresh_slots: int | None = None, coverage: Any = None) -> FirstToken:
    """The first token's time for a ``prompt_tokens`` prompt on the CPU (see the module
    docstring); ``tier_slots``: the experts the tiers hold; ``wide``: per type, what a trunk
    product past its native token limit costs (a type without an entry is priced as native);
    ``replay`` and ``slow_replay``: the fast and slow ends' routing (None at the slow end:
    uniform); ``trunk_reread``: bytes of a trunk the cap evicts read again by each batch
    (slow, fast end: ``plan.rereads.trunk_reread_bytes``); ``drive``: the share of the
    experts the drive serves (``coldstart.drive_share``: the rest is mapped from the page
    cache, neither read nor faulted into fresh memory); ``verify``: CPU s/GB of the checksums
    of each expert's first load, read or mapped (``coldstart.verify_cost``); ``fresh_slots``:
    the slots whose fresh pages the prompt's reads fault in where not ``tier_slots`` (a prompt
    window's spare slots, ``cache.window``); ``coverage``: the store's prompts' learned
    coverage, which both ends take over the replays where the runs counted it."""
    wide = wide or {}
    cpu = rates.cpu
    head = next((m for m in g.trunk_matrices if m.rows == g.n_vocab), None)
    body = [m for m in g.trunk_matrices if m is not head]
    n_moe = max(1, len(g.moe_layers))
    exp_el = sum(m.elements for layer in g.expert_parts for m in layer) / n_moe
    ext = sum(g.extent_bytes) / n_moe
    sizes = [batch] * (prompt_tokens // batch) + [prompt_tokens % batch] * bool(prompt_tokens % batch)
    compute, reads, loaded, experts = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    for i, end in enumerate(("slow", "fast")):
        per_expert = sum(compute_cost(cpu, layer, end, quantized=True)
                         for layer in g.expert_parts) / n_moe

        def product(m: Matrix, b: int) -> float:      # one trunk matrix by a batch of b tokens
            w = wide.get(m.ggml_type)
            s = w.seconds(m.count * m.elements, b, gemm, end) if w and b > w.limit else None
            if s is not None:
                return s
            return (compute_cost(cpu, [m], end, quantized=True)
                    + 2.0 * b * m.count * m.elements / (gemm.at(end) * 1e9))

        trunk_s = {b: sum(product(m, b) for m in body) for b in set(sizes)}
        touched = {b: touched_per_layer(g, b, slow_replay if end == "slow" else replay, coverage)
                   * n_moe for b in set(sizes)}               # experts a batch touches, all layers
        for j, b in enumerate(sizes):
            flops = 2.0 * b * n_moe * g.k * exp_el                  # the routed experts'
            e = flops / (gemm.at(end) * 1e9) + touched[b] * per_expert
            experts[i] += e
            compute[i] += e + trunk_s[b]
            if j == 0 or touched[b] > tier_slots:             # the tier cannot keep them all
                loaded[i] += touched[b] * ext
                reads[i] += touched[b] * ext * drive
            reads[i] += trunk_reread[i]
        if head is not None:
            compute[i] += (compute_cost(cpu, [head], end, quantized=True)
                           + 2.0 * head.elements / (gemm.at(end) * 1e9))
    r_slow = reads[0] / (rates.storage.slow * 1e9)
    r_fast = reads[1] / (rates.storage.fast * 1e9)
    fresh = (tier_slots if fresh_slots is None else fresh_slots) * ext
    fresh_s = (min(reads[0], fresh) / 1e9 * rates.read_cpu.slow,
               min(reads[1], fresh) / 1e9 * rates.read_cpu.fast)
    every = sum(g.extent_bytes) * g.n_experts                 # each expert checked once
    verify_s = ((min(loaded[0], every) / 1e9 * verify.slow, min(loaded[1], every) / 1e9
                 * verify.fast) if verify is not None else (0.0, 0.0))
    cpu = (compute[0] + fresh_s[0] + verify_s[0], compute[1] + fresh_s[1] + verify_s[1])
    # fast end: a layer's experts computed as their reads land, the rest of the CPU after
    return FirstToken(prompt_tokens, cpu[0] + r_slow, cpu[1] - experts[1] + max(experts[1], r_fast),
                      (compute[0], compute[1]), (reads[0], reads[1]), gemm, fresh_s, drive,
                      verify_s, coverage.describe(g.n_experts) if coverage is not None else "",
                      (experts[0], experts[1]))
