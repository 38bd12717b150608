"""Cost of a cache hit: ``policy.access(key, now)`` on a resident expert, per policy (target < 20 µs).

    python bench/bench_cache_hit.py                 # table: ns per hit, min and median of 7 runs
    pytest bench/bench_cache_hit.py -q --benchmark-columns=min,median,ops   # pytest-benchmark

A cache of 2048 slots over 32 layers x 128 experts is filled from a synthetic trace, then
routes of 8 resident experts are accessed in a shuffled order with the clock advancing once per
route, as the engine would for a decode step whose experts are all resident. Each timed call
does ``HITS`` accesses; the figure is per access. The key is the simulator's int key.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

from expertfs.runtime.policies.registry import make_factory

N_LAYERS, N_EXPERTS, K, SLOTS, HITS = 32, 128, 8, 2048, 8192
POLICIES = ("lru", "lru/layer", "lfu", "lfud", "arc", "wlfu", "wlfu/layer")


def _layer_of(key: int) -> int:
    return key // N_EXPERTS


def make_warm(name: str):
    """A full cache and a list of (key, now) accesses that all hit."""
    p = make_factory(name, n_layers=N_LAYERS, route_width=K, layer_of=_layer_of)(SLOTS)
    rng = random.Random(0)
    per_layer = SLOTS // N_LAYERS
    resident = [la * N_EXPERTS + e for la in range(N_LAYERS) for e in range(per_layer)]
    for t, key in enumerate(resident):
        if not p.access(key, t // K):
            p.admit(key, t // K)
    assert all(key in p for key in resident), name
    t0 = len(resident) // K
    seq = []
    for i in range(HITS // K):
        la = i % N_LAYERS
        route = rng.sample(range(per_layer), K)
        seq.extend((la * N_EXPERTS + e, t0 + i // N_LAYERS) for e in route)
    return p, seq


def hit_loop(p, seq) -> None:
    access = p.access
    for key, now in seq:
        access(key, now)


def ns_per_hit(name: str, repeats: int = 7) -> tuple[float, float]:
    """(min, median) over ``repeats`` runs of nanoseconds per hit."""
    p, seq = make_warm(name)
    times = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        hit_loop(p, seq)
        times.append((time.perf_counter_ns() - t) / len(seq))
    assert all(p.access(k, seq[-1][1]) for k, _ in seq[:64])
    return min(times), statistics.median(times)


try:
    import pytest

    @pytest.mark.parametrize("name", POLICIES)
    def test_hit(benchmark, name: str) -> None:
        """Per call: HITS accesses; divide the time by HITS for the cost of one hit."""
        p, seq = make_warm(name)
        benchmark(hit_loop, p, seq)
except ImportError:                      # the script needs no pytest
    pass


def main() -> int:
    print(f"{'policy':<12}{'min ns/hit':>11}{'median':>8}   ({SLOTS} slots, {N_LAYERS}x{N_EXPERTS} "
          f"experts, top-{K}, Python {sys.version.split()[0]})")
    for name in POLICIES:
        lo, med = ns_per_hit(name)
        print(f"{name:<12}{lo:11.0f}{med:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
