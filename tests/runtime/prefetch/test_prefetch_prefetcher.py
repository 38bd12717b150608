"""The prefetcher's bookkeeping against a fake cache: in-flight bound, refusals, dedupe,
coverage / recall / precision per source, and late and wasted bytes from the listener."""

from __future__ import annotations

import pytest

from expertfs.runtime.prefetch import Prefetcher


class FakeCache:
    """Answers like the mechanism: resident set, a free-slot count, reads in flight."""

    def __init__(self, free: int, resident=()):
        self.free = free
        self.resident = set(resident)
        self.inflight: list[tuple[int, int]] = []
        self.calls: list[tuple[int, int, str]] = []

    def start_prefetch(self, layer, expert, source):
        self.calls.append((layer, expert, source))
        if (layer, expert) in self.resident:
            return "resident"
        if self.free == 0:
            return "refused"
        self.free -= 1
        self.inflight.append((layer, expert))
        self.resident.add((layer, expert))
        return "issued"

    def prefetch_in_flight(self):
        return len(self.inflight)

    def expert_bytes(self, layer, expert):
        return 1000 + layer


def test_in_flight_bound_and_order():
    c = FakeCache(free=100)
    p = Prefetcher(c, max_in_flight=3)
    assert p.submit("gate", 2, [9, 8, 7, 6, 5]) == 3
    assert [e for _, e, _ in c.calls] == [9, 8, 7]          # best first
    st = p.stats("gate")
    assert (st.score.predicted, st.issued, st.refused, st.issued_bytes) == (5, 3, 2, 3 * 1002)
    c.inflight.clear()
    assert p.submit("gate", 2, [6, 5]) == 0                   # already predicted for this visit
    assert p.submit("gate", 3, [6, 5]) == 2


def test_refusal_stops_and_resident_counts():
    c = FakeCache(free=1, resident={(1, 4)})
    p = Prefetcher(c, max_in_flight=10)
    assert p.submit("history", 1, [4, 2, 3, 1]) == 1
    st = p.stats("history")
    assert (st.resident, st.issued, st.refused) == (1, 1, 2)
    assert len(c.calls) == 3


def test_max_per_submit():
    p = Prefetcher(FakeCache(free=10), max_in_flight=10, max_per_submit=2)
    assert p.submit("mtp", 0, [1, 2, 3]) == 2
    assert p.stats("mtp").refused == 1


def test_coverage_recall_precision_per_source():
    c = FakeCache(free=100)
    p = Prefetcher(c, max_in_flight=100)
    p.submit("gate", 5, [1, 2, 3, 4])
    p.submit("history", 5, [3, 4, 9])
    assert p.active(5) and not p.active(6)
    # layer 5 runs with 1, 3, 7, 9; 3 was still loading (not in time)
    p.on_route(5, [1, 3, 7, 9], [True, False, False, True])
    g, h = p.stats("gate"), p.stats("history")
    assert (g.score.needed, g.score.hits, g.score.covered) == (4, 2, 1)
    assert g.score.recall == 0.5 and g.score.coverage == 0.25 and g.score.precision == 0.5
    assert (h.score.needed, h.score.hits, h.score.covered) == (4, 2, 1)
    assert h.score.precision == pytest.approx(2 / 3)
    assert not p.active(5)
    p.on_route(5, [1], [True])                                # no predictions pending: ignored
    assert g.score.needed == 4
    rep = p.report()
    assert set(rep) == {"gate", "history"} and rep["gate"]["coverage"] == 0.25


def test_listener_counts_used_late_and_waste():
    p = Prefetcher(FakeCache(free=10))
    p.on_used("gate", 100)
    p.on_late("gate", 300)
    p.on_wasted("gate", 500, False)
    p.on_wasted("gate", 0, True)
    g = p.stats("gate")
    assert (g.used, g.late, g.late_bytes, g.wasted, g.wasted_bytes, g.cancelled) == \
        (1, 1, 300, 2, 500, 1)


def test_zero_bound_issues_nothing():
    c = FakeCache(free=10)
    p = Prefetcher(c, max_in_flight=0)
    assert p.submit("gate", 0, [1, 2]) == 0 and not c.calls
