"""The slow end's read/compute overlap (``plan.overlap``): the expectation by hand, its bounds,
and that the slow end stays monotone in the miss rate."""

from __future__ import annotations

from math import comb

import pytest

from expertfs.runtime.plan.overlap import expected_overlap


def test_by_hand_two_experts() -> None:
    # one layer, k = 2, half of the experts missing: one miss with probability 1/2; that layer
    # reads one expert (2 s) while computing the other (0.5 s): 0.5 s overlapped
    assert expected_overlap(2, 0.5, 2.0, [1.0]) == pytest.approx(0.25)


@pytest.mark.parametrize("k, q", [(1, 0.5), (8, 0.0), (8, 1.0)])
def test_nothing_to_overlap(k: int, q: float) -> None:
    # one expert, every expert in RAM, or every expert read: no layer has both
    assert expected_overlap(k, q, 1.0, [0.1] * 4) == 0.0


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
    # all-but-certain misses: only layers with an expert in overlap, as the binomial says
    q = 0.99
    read = n * k * q * per_read
    want = n * sum(comb(k, m) * q**m * (1 - q) ** (k - m) * min(m * per_read, (k - m) * layer / k)
                   for m in range(1, k))
    assert expected_overlap(k, q, read, [layer] * n) == pytest.approx(want)
