"""Cache policies on explicit access sequences with a fake clock (no wall time anywhere)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertfs.errors import UsageError
from expertfs.store.layout import ExpertKey
from expertfs.runtime.policies.base import LRU, CapacityError, DecayLFU, Policy, usage_rates
from expertfs.runtime.policies.arc import ARC
from expertfs.runtime.policies.layer import PerLayer, even_quotas
from expertfs.runtime.policies.registry import (ALL_POLICIES, DEFAULT_POLICY, make_factory,
                                                parse_policies)
from expertfs.runtime.policies.window import WindowLFU


def replay(p: Policy, seq, *, now=None) -> list[bool]:
    """Access each key (clock = position unless given); insert on a miss. Returns hits."""
    out = []
    for i, key in enumerate(seq):
        t = i if now is None else now
        hit = p.access(key, t)
        if not hit:
            p.admit(key, t)
        out.append(hit)
    return out


def resident(p: Policy, universe) -> set:
    return {k for k in universe if k in p}


# ---- LRU ------------------------------------------------------------------------------------

def test_lru_evicts_least_recent() -> None:
    p = LRU(3)
    assert replay(p, "abcab") == [False, False, False, True, True]
    p.admit("d", 5)                    # c is the least recent
    assert resident(p, "abcd") == set("abd")


def test_lru_skips_pinned_and_fails_loudly_when_all_pinned() -> None:
    p = LRU(2)
    replay(p, "ab")
    p.pinned.add("a")
    assert p.victim("c") == "b"
    p.pinned.add("b")
    with pytest.raises(CapacityError, match="pinned"):
        p.victim("c")
    assert issubclass(CapacityError, UsageError)


# ---- LFU with decay -------------------------------------------------------------------------

def test_lfu_keeps_the_frequent_and_breaks_ties_by_recency() -> None:
    p = DecayLFU(2, None)
    replay(p, "aaab")
    p.admit("c", 4)                    # b (1 use) goes, a (3 uses) stays
    assert resident(p, "abc") == {"a", "c"}
    p.access("d", 5)
    assert p.victim("d") == "c"        # c: 1 use
    q = DecayLFU(2, None)
    replay(q, "xy")                    # equal counts: the older one goes
    assert q.victim("z") == "x"


def test_lfu_remembers_history_of_evicted_keys() -> None:
    p = DecayLFU(1, None)
    replay(p, "aaab")                  # a evicted by b, with 3 uses on record
    assert p.access("a", 4) is False
    p.admit("a", 4)
    p.access("c", 5)
    assert p.score("a") == 4 and p.victim("c") == "a"


def test_decay_lets_recent_use_beat_old_frequency() -> None:
    p = DecayLFU(2, half_life=1.0)
    for t in range(4):                 # a: 4 uses at t = 0..3
        replay(p, "a", now=t)
    replay(p, "b", now=4)
    p.access("c", 30)                  # a's score has halved 27+ times; b's only once more
    assert p.victim("c") == "a"
    plain = DecayLFU(2, None)
    for t in range(4):
        replay(plain, "a", now=t)
    replay(plain, "b", now=4)
    plain.access("c", 30)
    assert plain.victim("c") == "b"


def test_decay_survives_a_long_clock() -> None:
    p = DecayLFU(2, half_life=0.5)     # rebases every ~256 tokens
    for t in range(0, 100_000, 7):
        replay(p, "a", now=t)
        if t % 49 == 0:
            replay(p, "b", now=t)
        replay(p, f"x{t}", now=t)
    assert "a" in p


def test_decay_lfu_rejects_bad_half_life() -> None:
    with pytest.raises(UsageError):
        DecayLFU(2, half_life=0)
    with pytest.raises(UsageError):
        LRU(0)


# ---- ARC ------------------------------------------------------------------------------------

def test_arc_is_scan_resistant() -> None:
    p = ARC(4)
    replay(p, "abab")                  # a, b frequent (T2)
    replay(p, [f"s{i}" for i in range(20)])   # a one-time scan
    assert {"a", "b"} <= resident(p, "ab")


def test_arc_ghost_hits_adapt_the_target() -> None:
    p = ARC(2)
    replay(p, "abac")                  # a frequent (T2); b evicted from T1 into ghost B1
    assert "b" in p.b1 and p.p == 0
    replay(p, "b")                     # a ghost hit: grow the recency side
    assert p.p > 0 and "b" in p.t2


def test_arc_bounds_its_ghosts() -> None:
    p = ARC(3)
    replay(p, [i % 50 for i in range(400)])
    assert len(p) <= 3 and len(p.t1) + len(p.b1) <= 3
    assert len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 6


# ---- window LFU -----------------------------------------------------------------------------

def test_window_lfu_new_key_survives_its_window() -> None:
    p = WindowLFU(4, window=2, half_life=None)
    replay(p, "hhhhgggg")              # h, g frequent
    replay(p, "xy")                    # one-off keys fill the window
    assert resident(p, "hgxy") == set("hgxy")
    replay(p, "z")                     # x leaves the window, loses the duel to h and g
    assert resident(p, "hgxyz") == set("hgyz")
    assert p.access("y", 20) is True


def test_window_lfu_seed_after_reads_fills_only_its_room() -> None:
    """A warm start seeded once keys are resident (a prompt read them first) takes the room
    left and evicts none of them: the cache's slots and the policy stay in step."""
    p = WindowLFU(10, window=2, half_life=None)
    replay(p, "aabbccdef")             # window and frequency region both hold keys
    held = resident(p, "abcdef")
    assert held == set("abcdef")
    got = p.seed({k: 1.0 + i for i, k in enumerate("ghijklmn")}, 30)
    assert len(got) == 4 and len(p) == 10
    assert resident(p, "abcdef") == held


def test_window_lfu_key_that_became_frequent_wins_its_duel() -> None:
    p = WindowLFU(2, window=1, half_life=None)
    replay(p, "ab")                    # b in the window, a in the frequency region
    replay(p, "bbbb")
    replay(p, "c")                     # b (5 uses) leaves the window and beats a (1 use)
    assert resident(p, "abc") == {"b", "c"}
    replay(p, "d")                     # c (1 use) leaves the window and loses to b
    assert resident(p, "abcd") == {"b", "d"}


def test_window_lfu_evicts_from_a_part_full_window_when_the_rest_is_pinned() -> None:
    """Seeded hot keys fill the frequency region, the window is not full, and the running
    layer pins the hot keys: the window's unpinned key is the victim (it was a CapacityError
    with a free slot's worth of unpinned keys, at a tier of exactly k slots)."""
    p = WindowLFU(4, window=4, half_life=None)
    p.seed({"a": 5.0, "b": 4.0}, 0)
    replay(p, "cd")
    p.pinned |= {"a", "b", "d", "e"}
    assert p.victim("e") == "c"
    p.pinned.add("c")
    with pytest.raises(CapacityError):
        p.victim("e")


def test_window_lfu_without_room_for_its_window_is_plain_decayed_lfu() -> None:
    p, q = WindowLFU(3, window=4, half_life=8), DecayLFU(3, half_life=8)
    seq = [i % 5 for i in range(40)] + [0, 0, 1] * 5
    assert p.window == 0 and replay(p, seq) == replay(q, seq)


def test_window_lfu_window_never_exceeds_its_size() -> None:
    p = WindowLFU(10, window=3)
    replay(p, [i % 17 for i in range(200)])
    assert len(p.win) <= 3 and len(p) <= 10


# ---- per-layer quotas -----------------------------------------------------------------------

def test_even_quotas() -> None:
    assert even_quotas(10, 3) == [4, 3, 3]
    with pytest.raises(UsageError, match="quotas"):
        PerLayer(2, LRU, lambda k: k[0], n_layers=3)


def test_per_layer_quota_is_a_wall() -> None:
    p = PerLayer(4, LRU, lambda k: k[0], n_layers=2)
    replay(p, [(0, 1), (0, 2), (1, 1)])
    replay(p, [(0, 3)])                # layer 0 is full: evicts (0, 1), though layer 1 has room
    assert (0, 1) not in p and (1, 1) in p and len(p) == 3
    assert p.name == "lru/layer"


def test_per_layer_quotas_below_a_route_are_refused() -> None:
    """A layer's quota must hold the experts a token uses of it at once (else the first token
    failed with a CapacityError out of the cache)."""
    make_factory("lru/layer", n_layers=2, route_width=4, layer_of=lambda k: k % 2)(8)
    with pytest.raises(UsageError, match="gives a layer 3 of the tier's 7 slots.*uses 4"):
        make_factory("lru/layer", n_layers=2, route_width=4, layer_of=lambda k: k % 2)(7)


def test_per_layer_shares_pinned() -> None:
    p = PerLayer(2, LRU, lambda k: k[0], n_layers=2)
    replay(p, [(0, 1), (1, 1)])
    p.pinned.add((0, 1))
    with pytest.raises(CapacityError):
        p.victim((0, 2))
    p.pinned = {(1, 1)}                # rebinding reaches the sub-policies too
    assert p.victim((0, 2)) == (0, 1)


# ---- warm start -----------------------------------------------------------------------------

def test_usage_rates_from_store_counts() -> None:
    usage = {(0, 1): 30, (0, 2): 10, ExpertKey(1, 5): 8}
    r = usage_rates(usage, k=2)        # layer 0 saw 20 tokens, layer 1 saw 4
    assert r == {(0, 1): 1.5, (0, 2): 0.5, (1, 5): 2.0}


@pytest.mark.parametrize("make", [LRU, ARC, lambda c: DecayLFU(c, 64),
                                  lambda c: WindowLFU(c, 2, 64)])
def test_seed_loads_hottest(make) -> None:
    p = make(2)
    loaded = p.seed({"a": 0.9, "b": 0.1, "c": 0.5}, 0)
    assert set(loaded) == {"a", "c"} and resident(p, "abc") == {"a", "c"}
    replay(p, "d", now=1)
    assert "a" in p                    # the hottest is the last to go


def test_seeded_frequency_protects_learned_hot_keys() -> None:
    p = DecayLFU(2, None, prior_tokens=100)
    p.seed({"hot": 0.5}, 0)
    replay(p, "xyxyxy", now=1)         # 3 uses each, far below the 50 the prior is worth
    assert "hot" in p


# ---- every policy: protocol invariants against a shadow model --------------------------------

FACTORIES = {name: make_factory(name, n_layers=3, route_width=2, layer_of=lambda k: k % 3)
             for name in ALL_POLICIES + ("lfud@4", "wlfu@8")}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(FACTORIES)), cap=st.integers(3, 9),
       rows=st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=2, unique=True),
                     max_size=120))
def test_protocol_invariants(name: str, cap: int, rows) -> None:
    if name.endswith("/layer"):
        cap = max(cap, 6)               # quotas of the route width (2) on each of 3 layers
    p = FACTORIES[name](cap)
    shadow: set[int] = set()
    for t, row in enumerate(rows):
        if name.endswith("/layer"):
            if len({k % 3 for k in row}) < len(row):
                continue                # a row holds at most one key per layer here
        p.pinned.clear()
        p.pinned.update(row)
        for key in row:
            hit = p.access(key, t)
            assert hit == (key in shadow)
            if hit:
                continue
            v = p.victim(key)
            if v is not None:
                assert v in shadow and v not in row
                p.on_evict(v)
                shadow.discard(v)
            p.on_insert(key, t)
            shadow.add(key)
            assert len(p) == len(shadow) <= cap
    assert all(k in p for k in shadow)


def test_registry() -> None:
    assert DEFAULT_POLICY in ALL_POLICIES
    assert parse_policies("all") == list(ALL_POLICIES)
    assert parse_policies("LRU, wlfu@32/layer") == ["lru", "wlfu@32/layer"]
    for bad in ["lru@3", "fifo", "lru/global", "lfud@x", "lfud@-1", ""]:
        with pytest.raises(UsageError):
            parse_policies(bad)
    assert FACTORIES["wlfu"](100).window == 6
    assert FACTORIES["wlfu/layer"](9).subs[0].window == 2
