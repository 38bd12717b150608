"""The slow end's read/compute overlap (``plan.overlap``): the expectation by hand, its bounds,
and that the slow end stays monotone in the miss rate."""

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
