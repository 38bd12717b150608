"""The slow end's read/compute overlap (``plan.overlap``): the expectation by hand, its bounds,
and that the slow end stays monotone in the miss rate; the band from the two ends."""

from __future__ import annotations

from math import comb

import pytest

from expertfs.runtime.plan.overlap import expected_overlap, layer_overlap


def test_by_hand_two_experts() -> None:
    # one layer, k = 2, half of the experts missing; reads 2 s each, products 0.5 s each.
    # One miss (probability 1/2): the resident product runs during the read, 0.5 s overlapped.
    # Two misses (1/4): the first's product runs during the second's read, 0.5 s overlapped.
    assert expected_overlap(2, 0.5, 2.0, [1.0]) == pytest.approx(0.5 * 0.5 + 0.25 * 0.5)


def test_layer_pipeline_by_hand() -> None:
    # 8 experts, products 1 s; reads 0.5 s: every read hidden behind the resident products
    # (3 misses), or behind the landed ones' (8 misses: only the first read is not)
    assert layer_overlap(8, 3, 0.5, 1.0) == pytest.approx(1.5)
    assert layer_overlap(8, 8, 0.5, 1.0) == pytest.approx(3.5)
    # reads 2 s: the products hide behind the reads but the last landed one's
    assert layer_overlap(8, 8, 2.0, 1.0) == pytest.approx(7.0)
    assert layer_overlap(8, 0, 2.0, 1.0) == 0.0


@pytest.mark.parametrize("k, q", [(1, 0.5), (8, 0.0)])
def test_nothing_to_overlap(k: int, q: float) -> None:
    # one expert (its product waits for its read), or every expert in RAM: nothing to overlap
    assert expected_overlap(k, q, 1.0, [0.1] * 4) == 0.0


def test_every_expert_missing_still_overlaps() -> None:
    # each landed expert is computed while the next is read
    assert expected_overlap(8, 1.0, 0.04, [0.004] * 4) == pytest.approx(4 * 7 * 0.0005)


@pytest.mark.parametrize("q", [0.05, 0.3, 0.7, 0.95])
def test_bounded_by_reads_and_by_compute(q: float) -> None:
    ov = expected_overlap(8, q, 0.04, [0.002] * 48)
    assert 0 < ov <= min(0.04, 48 * 0.002)


def test_slow_end_grows_with_the_miss_rate() -> None:
    # slow = compute + reads - overlap must not fall as more experts miss (each expert's read
    # time fixed): the overlap never gives back more than the reads it adds
    k, n, per_read, layer = 8, 10, 0.004, 0.006
    prev = 0.0
    for i in range(1, 100):
        q = i / 100
        read = n * k * q * per_read
        slow = n * layer + read - expected_overlap(k, q, read, [layer] * n)
        assert slow >= prev - 1e-12
        prev = slow
    # all-but-certain misses: the expectation of the pipeline's overlap over the binomial
    q = 0.99
    read = n * k * q * per_read
    c = layer / k
    want = n * sum(comb(k, m) * q**m * (1 - q) ** (k - m)
                   * (m * per_read + layer - max(layer, m * per_read + c, per_read + m * c))
                   for m in range(1, k + 1))
    assert expected_overlap(k, q, read, [layer] * n) == pytest.approx(want)


# --- the band's two ends over a token (plan.predict) ---------------------------------------------

def _streaming(name: str):
    """A model whose RAM tier under a 16 GiB box holds a fraction of its experts, with CPU rates
    that price each MoE layer natively (so ``predict`` counts the structural overlap)."""
    import dataclasses

    from expertfs.cli.plan import geometry_from_like
    from expertfs.runtime.plan.budget import Box, layout
    from expertfs.runtime.plan.native import layer_key
    from expertfs.runtime.plan.rates import LinearCost, Range, stated_cpu

    g = geometry_from_like(name)
    box = Box(16 * 2**30, 0, ctx=4096)
    mem = layout(g, box, "cpu", "quant")
    layer = LinearCost(Range(0.0, 0.0, "t"), Range(40.0, 60.0, "t"))
    cpu = dataclasses.replace(stated_cpu(), layer_s=Range(1e-4, 5e-5, "t"),
                              token_s=Range(0.0, 0.0, "t"),
                              layers={layer_key(p, g.k): layer for p in g.expert_parts})
    return g, box, mem, cpu


def _predict(name: str):
    from expertfs.runtime.plan.predict import Range, Rates, Routing, RoutingRange, predict
    from expertfs.runtime.plan.rates import stated_gpu, stated_pcie

    g, box, mem, cpu = _streaming(name)
    mib = 2**20
    slow = Routing("a", True, "wlfu", 100, 0.0, 0.6, 0.4, 300 * mib, 0, 0)
    fast = Routing("b", True, "wlfu", 100, 0.0, 0.7, 0.3, 200 * mib, 0, 0)
    rates = Rates(Range(1.5, 3.0, "t"), stated_pcie(4), cpu, stated_gpu(["Q4_K"]),
                  miss_cpu=Range(0.1, 0.05, "t"), verify=Range(0.04, 0.02, "t"))
    return g, mem, predict(g, mem, RoutingRange(slow, fast), rates, box)


def test_fast_end_overlaps_a_routed_layer_only_where_the_lookahead_is_off() -> None:
    """qwen3moe streams with the lookahead off by default: a layer's misses are read once it is
    routed, so the fast end is compute + reads - the structural overlap at fast rates, not the
    larger of the two; glm5-next turns the lookahead on and keeps the larger."""
    from expertfs.runtime.plan.overlap import lookahead_overlaps

    g, mem, pr = _predict("Qwen3-30B-A3B")
    assert not lookahead_overlaps(g, mem)
    t = {x.name: x for x in pr.terms}
    io = t["storage"].fast_s + t["first_reads"].fast_s
    compute = sum(x.fast_s for x in pr.terms
                  if x.name not in ("storage", "first_reads", "overlap"))
    assert 0 < -t["overlap"].fast_s < min(io, compute)
    assert pr.fast_s == pytest.approx(compute + io + t["overlap"].fast_s)
    assert pr.fast_s > max(compute, io) and pr.slow_s > pr.fast_s

    g, mem, pr = _predict("GLM-5.3-Flash")
    assert lookahead_overlaps(g, mem)
    t = {x.name: x for x in pr.terms}
    io = t["storage"].fast_s + t["first_reads"].fast_s
    compute = sum(x.fast_s for x in pr.terms
                  if x.name not in ("storage", "first_reads", "overlap"))
    assert t["overlap"].fast_s == 0.0 and pr.fast_s == pytest.approx(max(compute, io))


def test_the_misses_cpu_is_priced_at_both_ends() -> None:
    """The reads' CPU (system calls, completions) at both ends, the first-read checksums at the
    slow end only (a long run's misses are re-reads)."""
    _, _, pr = _predict("Qwen3-30B-A3B")
    t = pr.term("read_cpu")
    mib = 2**20
    assert t.slow_s == pytest.approx(300 * mib / 1e9 * (0.1 + 0.04))
    assert t.fast_s == pytest.approx(200 * mib / 1e9 * 0.05)
    assert "first-read checksums" in t.detail


def test_band_is_the_range_of_the_two_ends() -> None:
    # a faster drive's warm start reads more during a short run: the fast end can come out the
    # slower, and the band still runs from the slower end's rate to the faster one's
    from expertfs.runtime.plan.predict import Prediction
    p = Prediction(terms=(), slow_s=0.050, fast_s=0.052, dominant_slow="x", dominant_fast="x")
    assert p.tok_s_low == pytest.approx(1 / 0.052) and p.tok_s_high == pytest.approx(20.0)
    q = Prediction(terms=(), slow_s=0.0, fast_s=0.0, dominant_slow="x", dominant_fast="x")
    assert q.tok_s_low == q.tok_s_high == float("inf")
