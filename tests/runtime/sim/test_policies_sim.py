"""The Belady bound (against brute force), the static-frequency cache and the two-tier simulator
(against invariants)."""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertfs.errors import UsageError
from expertfs.runtime.policies.base import LRU
from expertfs.runtime.sim.bounds import belady_hits, next_uses, static_hits
from expertfs.runtime.policies.registry import ALL_POLICIES, make_factory
from expertfs.runtime.sim.replay import Replay, simulate, slots_for, usage_counts
from expertfs.runtime.trace.file import TraceChunk, TraceHeader, TraceWriter
from expertfs.runtime.trace.synth import SyntheticSpec, synthetic_chunks, synthetic_header


def brute_force_opt(rows: list[list[int]], cap: int, prefill: bool = False) -> int:
    """Most hits over every eviction choice (exponential; tiny inputs only)."""
    seq = [(r, k) for r, row in enumerate(rows) for k in row]

    @lru_cache(maxsize=None)
    def best(i: int, cache: frozenset) -> int:
        if i == len(seq):
            return 0
        r, key = seq[i]
        if key in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < cap:
            return best(i + 1, cache | {key})
        pinned = set(rows[r])
        return max((best(i + 1, (cache - {v}) | {key}) for v in cache if v not in pinned),
                   default=-10**9)

    if not prefill:
        return best(0, frozenset())
    keys = sorted({k for row in rows for k in row})
    return max(best(0, frozenset(c)) for c in itertools.combinations(keys, min(cap, len(keys))))


def test_next_uses() -> None:
    assert next_uses([1, 2, 1, 3, 2, 1]) == [2, 4, 5, 6, 6, 6]


@settings(max_examples=120, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=2, unique=True),
                     min_size=1, max_size=9),
       cap=st.integers(2, 4), prefill=st.booleans())
def test_belady_is_optimal(rows, cap, prefill) -> None:
    assert belady_hits(rows, cap, prefill=prefill) == brute_force_opt(rows, cap, prefill)


def test_static_frequency_cache() -> None:
    rows = [[1, 2], [3, 1], [1, 4], [2, 3], [1, 2]]        # uses: 1 x4, 2 x3, 3 x2, 4 x1
    assert static_hits(rows, 3) == 4 - 1                     # key 1 pinned, read once
    assert static_hits(rows, 3, prefill=True) == 4
    assert static_hits(rows, 4) == (4 - 1) + (3 - 1)         # keys 1 and 2
    assert static_hits([[5, 6], [7, 8]], 2) == 0             # nothing pinned: room for a row only
    with pytest.raises(UsageError, match="at once"):
        static_hits([[1, 2, 3]], 2)


@settings(max_examples=120, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=2, unique=True),
                     min_size=1, max_size=9),
       cap=st.integers(2, 4))
def test_static_cache_never_beats_belady(rows, cap) -> None:
    assert 0 <= static_hits(rows, cap) <= belady_hits(rows, cap)


def test_belady_rejects_too_small_a_cache() -> None:
    with pytest.raises(UsageError, match="at once"):
        belady_hits([[1, 2, 3]], 2)


def _replay(spec: SyntheticSpec, drafts: bool = False) -> Replay:
    return Replay.from_chunks(synthetic_header(spec), synthetic_chunks(spec), include_drafts=drafts)


SPEC = SyntheticSpec(n_layers=4, n_experts=16, k=2, n_tokens=300, zipf=1.0, stickiness=0.4,
                     cross_layer=0.3, expert_bytes=1000)


def _factory(name: str, rp: Replay):
    return make_factory(name, n_layers=rp.header.n_layers, route_width=rp.header.k,
                        layer_of=rp.layer_of)


@pytest.mark.parametrize("name", ALL_POLICIES)
@pytest.mark.parametrize("cap", [8, 20, 40])
def test_no_policy_beats_belady(name: str, cap: int) -> None:
    rp = _replay(SPEC)
    r = simulate(rp, _factory(name, rp), vram=0, ram=cap)
    assert r.ram_hits <= belady_hits(rp.rows, cap)
    assert r.accesses == 300 * 4 * 2 == r.ram_hits + r.misses
    assert r.bytes_nvme == 1000 * r.misses and r.bytes_h2d == 0


def test_single_tier_equals_plain_replay() -> None:
    rp = _replay(SPEC)
    r = simulate(rp, LRU, vram=0, ram=12)
    p, hits = LRU(12), 0
    for row in rp.rows:
        p.pinned = set(row)
        for key in row:
            if p.access(key, 0):
                hits += 1
            else:
                p.admit(key, 0)
    assert r.ram_hits == hits and r.tokens == 300
    assert r.per_token(r.bytes_nvme) == r.misses * 1000 / 300


def test_exclusive_lru_tiers_are_one_lru_of_both_sizes() -> None:
    """Demoting VRAM's LRU victim to RAM's MRU keeps the global LRU order across the pair."""
    rp = _replay(SPEC)
    two = simulate(rp, LRU, vram=10, ram=14)
    one = simulate(rp, LRU, vram=0, ram=24)
    assert two.misses == one.misses
    assert two.vram_hits == simulate(rp, LRU, vram=10, ram=0).vram_hits
    assert two.bytes_h2d == 1000 * (two.accesses - two.vram_hits)
    assert two.bytes_d2h > 0 and two.bytes_nvme == 1000 * two.misses


def test_inclusive_tiers_miss_like_the_ram_tier_alone() -> None:
    rp = _replay(SPEC)
    inc = simulate(rp, LRU, vram=10, ram=24, inclusive=True)
    assert inc.misses == simulate(rp, LRU, vram=0, ram=24).misses
    assert inc.bytes_d2h == 0
    exc = simulate(rp, LRU, vram=10, ram=24)
    assert exc.misses < inc.misses          # exclusive tiers hold more distinct experts
    with pytest.raises(UsageError, match="RAM >= VRAM"):
        simulate(rp, LRU, vram=10, ram=5, inclusive=True)


@pytest.mark.parametrize("name", ALL_POLICIES)
@pytest.mark.parametrize("inclusive", [False, True])
def test_two_tier_bounds(name: str, inclusive: bool) -> None:
    rp = _replay(SPEC)
    r = simulate(rp, _factory(name, rp), vram=8, ram=16, inclusive=inclusive)
    assert r.vram_hits <= belady_hits(rp.rows, 8)
    total = 16 if inclusive else 24
    assert r.vram_hits + r.ram_hits <= belady_hits(rp.rows, total)
    assert r.vram_hits + r.ram_hits + r.misses == r.accesses


def test_capacity_checks() -> None:
    rp = _replay(SPEC)
    with pytest.raises(UsageError, match="at least 2"):
        simulate(rp, LRU, vram=1, ram=10)
    with pytest.raises(UsageError, match="no cache tier"):
        simulate(rp, LRU, vram=0, ram=0)


def test_warm_start_counts_its_bytes_and_helps() -> None:
    learn, test = _replay(SyntheticSpec(**{**SPEC.__dict__, "n_tokens": 600})).split(300)
    assert learn.n_tokens == 300 and test.n_tokens == 300
    counts = usage_counts(learn)
    assert sum(counts.values()) == 300 * 4 * 2
    from expertfs.runtime.policies.base import usage_rates
    rates = usage_rates(counts, k=2)
    f = _factory("wlfu", test)
    cold = simulate(test, f, vram=0, ram=16)
    warm = simulate(test, f, vram=0, ram=16, warm=rates)
    assert warm.bytes_warm == 16 * 1000 and cold.bytes_warm == 0
    assert warm.misses < cold.misses
    assert warm.ram_hits <= belady_hits(test.rows, 16, prefill=True)
    two = simulate(test, f, vram=6, ram=10, warm=rates)
    assert two.bytes_warm == 16 * 1000


def test_drafts_widen_rows(tmp_path) -> None:
    h = TraceHeader(2, 8, 2, (100, 200), n_draft=2)
    c = TraceChunk(np.array([0, 0], np.uint32), np.array([0, 1], np.uint16),
                   np.array([1, 2], np.uint8), np.array([[1, 2], [3, 4]], np.uint16),
                   np.ones((2, 2), np.float16), np.array([[[2, 5], [0, 0]], [[3, 6], [7, 3]]],
                                                          np.uint16), np.ones((2, 2, 2), np.float16))
    with TraceWriter(tmp_path / "d", h) as w:
        w.add_chunk(c)
    plain = Replay.from_file(tmp_path / "d")
    wide = Replay.from_file(tmp_path / "d", include_drafts=True)
    assert plain.rows == [[1, 2], [11, 12]]
    assert wide.rows == [[1, 2, 5], [11, 12, 14, 15]]
    assert wide.key_bytes(14) == 200 and wide.n_tokens == 1
    assert slots_for(1000, h) == 5
