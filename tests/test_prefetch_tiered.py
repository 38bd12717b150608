"""Prefetch through the real provider: an oracle lookahead turns every miss after the first route
into a hit and is scored as full coverage; the history predictor, fed by the provider's own
gets, covers part of a sticky trace; bytes stay the store's and invariants hold throughout."""

from __future__ import annotations

import pytest

from expertfs.runtime.cache import State
from expertfs.runtime.experts.tiered import TieredProvider
from expertfs.runtime.trace_synth import PRESETS, SyntheticSpec, synthetic_chunks
from expertfs.store import Store

from test_cache_support import K, N_EXPERTS, assert_weights, check_invariants, make_store, store_bytes


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store.open(str(make_store(tmp_path_factory.mktemp("prefetch_tiered"))))
    yield s
    s.close()


def routes(n_tokens: int, **kw):
    spec = SyntheticSpec(n_layers=3, n_experts=N_EXPERTS, k=K, n_tokens=n_tokens, **kw)
    out = []
    for c in synthetic_chunks(spec):
        out.extend(zip(c.layers.tolist(), c.experts.tolist()))
    return out


def settle(p):
    """Let every read in flight finish (stands in for the compute time of a layer)."""
    for e in list(p.cache.entries.values()):
        if e.state is State.LOADING:
            p.cache.loader.resolve(e).exception()
    p.cache.drain()


def slot(store):
    return max(store.extent(la, 0).length for la in store.layers)


@pytest.mark.parametrize("vram", [0, 8])
def test_oracle_lookahead_hides_every_miss(store, vram):
    data = store_bytes(store)
    rows = routes(40, **PRESETS["uniform"])
    layers = store.layers
    p = TieredProvider(store, ram_bytes=24 * slot(store), vram_bytes=vram * slot(store),
                       backend="buffered", warm_start=False, record_usage=False, staging_slots=3)
    try:
        for i, (li, ids) in enumerate(rows):
            layer = layers[li]
            if i + 1 < len(rows):                       # the next layer's route, known ahead
                nli, nids = rows[i + 1]
                p.prefetch(layers[nli], nids)
            settle(p)
            got = p.get(layer, ids)
            if i % 17 == 0:
                assert_weights(store, data, layer, got)
            p.release(layer)
            check_invariants(p)
        st = p.stats
        rep = p.prefetch_report()["gate"]
        assert st.misses == K                            # only the first route
        assert rep["coverage"] == 1.0 and rep["precision"] == 1.0 and rep["late"] == 0
        assert st.prefetch_used == rep["used"] == rep["issued"]
        assert st.prefetch_wasted == 0
    finally:
        p.close()


def test_history_prefetch_covers_a_sticky_trace(store):
    data = store_bytes(store)
    rows = routes(150, **PRESETS["sticky"])
    layers = store.layers
    results = {}
    for history in (False, True):
        p = TieredProvider(store, ram_bytes=20 * slot(store), backend="buffered",
                           warm_start=False, record_usage=False, history=history)
        try:
            for i, (li, ids) in enumerate(rows):
                settle(p)
                got = p.get(layers[li], ids)
                if i % 31 == 0:
                    assert_weights(store, data, layers[li], got)
                p.release(layers[li])
            check_invariants(p)
            results[history] = (p.stats.misses, p.prefetch_report())
        finally:
            p.close()
    misses_off, _ = results[False]
    misses_on, report = results[True]
    h = report["history"]
    assert h["issued"] > 0 and h["covered"] > 0 and 0 < h["coverage"] <= h["recall"] <= 1
    assert h["used"] + h["wasted"] <= h["issued"]
    assert misses_on < misses_off
