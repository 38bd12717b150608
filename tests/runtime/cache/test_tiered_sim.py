"""The real provider replays a routing trace with exactly the hits the simulator predicts.

Same trace, same policy, same slots: VRAM hits, RAM hits, misses and the bytes moved between
tiers must be equal, call for call, for one tier and for two exclusive tiers, cold and warm
started from learned usage. (The simulator is the model ``bench cache`` and ``plan`` use, so
this is what makes their predictions about the runtime true.)"""

from __future__ import annotations

import pytest

from expertfs.runtime.cache.provider import TieredProvider
from expertfs.runtime.policies.base import usage_rates
from expertfs.runtime.policies.registry import make_factory
from expertfs.runtime.sim.replay import Replay, simulate, usage_counts
from expertfs.runtime.trace.file import TraceHeader
from expertfs.runtime.trace.synth import SyntheticSpec, synthetic_chunks
from expertfs.store.reader import Store

from support.cache_store import K, N_EXPERTS, check_invariants, make_store

SPEC = SyntheticSpec(n_layers=3, n_experts=N_EXPERTS, k=K, n_tokens=120, zipf=1.0,
                     stickiness=0.4, cross_layer=0.3, seed=3)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store.open(str(make_store(tmp_path_factory.mktemp("tiered_sim"))))
    yield s
    s.close()


@pytest.fixture(scope="module")
def replay(store):
    sizes = tuple(store.extent(la, 0).length for la in store.layers)
    header = TraceHeader(SPEC.n_layers, SPEC.n_experts, SPEC.k, sizes)
    return Replay.from_chunks(header, synthetic_chunks(SPEC))


def run_provider(store, replay, policy, vram, ram, staging, *, warm=False):
    slot = max(store.extent(la, 0).length for la in store.layers)
    host = ram + staging if vram else ram
    p = TieredProvider(store, ram_bytes=host * slot, vram_bytes=vram * slot, policy=policy,
                       backend="buffered", warm_start=warm, record_usage=False,
                       staging_slots=staging if vram else None)
    try:
        assert p.describe()["ram_slots"] == ram
        layers = store.layers
        for i, row in enumerate(replay.rows):
            layer = layers[row[0] // N_EXPERTS]
            p.get(layer, [k % N_EXPERTS for k in row])
            p.release(layer)
            if i % 50 == 0:
                check_invariants(p)
        return p.stats
    finally:
        p.close()


TIERS = [(0, 8), (0, 24), (6, 9), (12, 21), (8, 0)]
CASES = [(p, v, r) for p in ("lru", "lfud", "arc", "wlfu") for v, r in TIERS] + \
        [("wlfu/layer", v, r) for v, r in TIERS if v in (0, 12) and r in (0, 21, 24)]   # k per layer


@pytest.mark.parametrize("policy,vram,ram", CASES)
def test_hits_equal_the_simulator(store, replay, policy, vram, ram):
    factory = make_factory(policy, n_layers=3, route_width=K, layer_of=replay.layer_of)
    sim = simulate(replay, factory, vram=vram, ram=ram)
    st = run_provider(store, replay, policy, vram, ram, staging=3)
    assert (st.hits.get("vram", 0), st.hits.get("ram", 0), st.misses) == \
        (sim.vram_hits, sim.ram_hits, sim.misses)
    assert st.bytes_h2d == (sim.bytes_h2d if vram else 0)
    assert st.bytes_d2h == sim.bytes_d2h
    # every miss is one read of its extent; warm reads are none here
    assert st.bytes_read == sim.bytes_nvme


def test_warm_start_hits_equal_the_simulator(store, replay):
    first, rest = replay.split(40)
    counts = usage_counts(first)
    from expertfs.runtime.cache import persist_usage
    layers = store.layers
    persist_usage(store, {(layers[la], e): n for (la, e), n in counts.items()})
    factory = make_factory("wlfu", n_layers=3, route_width=K, layer_of=replay.layer_of)
    rates = dict(sorted(usage_rates(counts, K).items()))    # the usage table's order (ties)
    sim = simulate(rest, factory, vram=0, ram=10, warm=rates)
    st = run_provider(store, rest, "wlfu", 0, 10, 0, warm=True)
    assert (st.hits.get("ram", 0), st.misses) == (sim.ram_hits, sim.misses)
    assert st.warm_bytes == sim.bytes_warm
