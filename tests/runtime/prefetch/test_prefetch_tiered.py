"""Prefetch through the real provider: an oracle lookahead turns every miss after the first route
into a hit and is scored as full coverage; the history predictor, fed by the provider's own
gets, covers part of a sticky trace; bytes stay the store's and invariants hold throughout."""

from __future__ import annotations

import time

import pytest

from expertfs.runtime.cache import State
from expertfs.runtime.cache.provider import TieredProvider
from expertfs.runtime.trace.synth import PRESETS, SyntheticSpec, synthetic_chunks
from expertfs.store.reader import Store

from support.cache_store import (K, N_EXPERTS, GatedBackend, assert_weights, check_invariants,
                                make_store, store_bytes)


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


def wait_for(cond, limit_s=30.0):
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < limit_s
        time.sleep(0.001)


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


def _tier(p) -> set[int]:
    """The keys in the RAM tier proper (staged prefetches excluded)."""
    return {k for k, e in p.cache.entries.items() if not e.staging}


def test_staged_prefetch_never_changes_the_tier(store):
    """With prefetch slots, predictions are read outside the tier: run the same routes with
    no prefetch, with wrong predictions only, and with the true next route plus wrong ones.
    After every get the tier holds the same experts in all three and hits and misses agree;
    true predictions serve their misses without a demand read, wrong ones evict nothing (and
    wait in their slots: a later route may still use them)."""
    data = store_bytes(store)
    rows = routes(60, **PRESETS["uniform"])
    layers = store.layers
    runs = {}
    for mode in ("none", "wrong", "true+wrong"):
        p = TieredProvider(store, ram_bytes=(20 + 2 * (K + 2)) * slot(store), backend="buffered",
                           warm_start=False, record_usage=False, prefetch_slots=2 * (K + 2))
        assert p.cache.slots.prefetch == 2 * (K + 2) and p.cache.slots.ram == 20
        tiers = []
        try:
            for i, (li, ids) in enumerate(rows):
                got = p.get(layers[li], ids)
                if i % 13 == 0:
                    assert_weights(store, data, layers[li], got)
                if mode != "none" and i + 1 < len(rows):
                    nli, nids = rows[i + 1]
                    wrong = [e for e in range(N_EXPERTS) if e not in nids][i % 5:i % 5 + 2]
                    p.prefetch(layers[nli], (list(nids) if mode == "true+wrong" else []) + wrong)
                settle(p)
                p.release(layers[li])
                check_invariants(p)
                tiers.append(_tier(p))
            runs[mode] = (tiers, p.stats.misses, dict(p.stats.hits), p.reader.stats["reads"],
                          p.stats.prefetch_issued, p.stats.prefetch_used, p.stats.prefetch_wasted)
        finally:
            p.close()
    tiers0, misses0, hits0, reads0, *_ = runs["none"]
    for mode in ("wrong", "true+wrong"):
        tiers, misses, hits, reads, issued, used, wasted = runs[mode]
        assert tiers == tiers0 and misses == misses0 and hits == hits0
        assert issued > 0 and reads == misses0 - used + issued   # a used one saved a read
    _, _, _, reads, issued, used, wasted = runs["wrong"]
    assert wasted > 0 and used < issued       # wrong for the next route (a later one may use it)
    _, _, _, reads, issued, used, wasted = runs["true+wrong"]
    first = len(set(rows[0][1]))
    assert used == misses0 - first            # every miss after the first route was staged
    assert reads == first + issued            # ... and never read on demand


def test_staged_prefetch_slots_are_bounded_and_reclaimed(store):
    """Staged predictions take at most their slots; more are refused until the layer they
    were for has run, and then the oldest finished ones make room (counted as waste)."""
    la, lb = store.layers[0], store.layers[1]
    p = TieredProvider(store, ram_bytes=(12 + 2) * slot(store), backend="buffered",
                       warm_start=False, record_usage=False, prefetch_slots=2)
    try:
        c = p.cache
        assert c.start_prefetch(lb, 0, "gate") == "issued"
        assert c.start_prefetch(lb, 1, "gate") == "issued"
        assert c.start_prefetch(lb, 2, "gate") == "refused"     # full, its layer has not run
        assert c.start_prefetch(lb, 0, "gate") == "resident"
        settle(p)
        check_invariants(p)
        p.get(la, [3, 4, 5, 6])                                  # not the layer they were for
        p.release(la)
        assert c.start_prefetch(lb, 2, "gate") == "refused"
        got = p.get(lb, [1, 7, 8, 9])                            # lb runs: 1 used, 0 wasted
        p.release(lb)
        assert 1 in got and p.stats.prefetch_used == 1 and 1 not in c.staged
        assert c.start_prefetch(la, 10, "gate") == "issued"      # the slot 1 left
        assert c.start_prefetch(la, 11, "gate") == "issued"      # reclaims 0
        assert 0 not in {e.expert for e in c.staged.values() if e.layer == lb}
        assert p.stats.prefetch_wasted == 1
        settle(p)
        check_invariants(p)
    finally:
        p.close()


def test_staged_predictions_still_queued_when_their_layer_runs_are_dropped_unread(store):
    """Predictions are read one at a time (the loader's drip); those of a layer that runs
    without them and are still queued then are dropped unread (cancelled, never issued), the
    one it asks for is issued at demand priority."""
    gate = GatedBackend()
    la, lb = store.layers[0], store.layers[1]
    p = TieredProvider(store, ram_bytes=(12 + 4) * slot(store), backend=gate, queue_depth=2,
                       warm_start=False, record_usage=False, prefetch_slots=4)
    try:
        c = p.cache
        gate.release.set()
        p.get(la, [0])
        p.release(la)
        gate.release.clear()
        for e in (4, 5, 6):
            assert c.start_prefetch(lb, e, "gate") == "issued"
        wait_for(lambda: gate.started)
        assert [c.loader.started(c.staged[c.key(lb, e)]) for e in (4, 5, 6)] == [True, False, False]
        resolve = c.loader.resolve
        calls = []

        def resolve_then_open(e):
            calls.append(e.key)
            fut = resolve(e)
            if len(calls) == 2:                           # joined 5 (1st), now waiting (2nd)
                gate.release.set()
            return fut
        c.loader.resolve = resolve_then_open
        got = p.get(lb, [5, 7])                           # 5 comes true; 4 and 6 were wrong
        p.release(lb)
        assert_weights(store, store_bytes(store), lb, got)
        st = p.stats
        assert st.prefetch_used == 1 and st.prefetch_cancelled == 1
        assert c.state_of(c.key(lb, 6)) is State.ABSENT   # never read
        assert {e.expert for e in c.staged.values()} == {4}   # read, kept until reclaimed
        settle(p)
        check_invariants(p)
    finally:
        p.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "glm5-next"])
def test_engine_lookahead_stages_its_prefetches_and_keeps_logits(tmp_path, arch):
    """``lookahead=True`` with a RAM tier smaller than the model: the lookahead reads into
    k + margin + 1 staged slots, and decoding is bit-identical to the uncached provider.
    glm5-next (mHC streams, its own block loop) predicts from its FFN blocks' inputs."""
    import torch

    from expertfs.store.repack import repack
    from expertfs.runtime.engine import Engine
    from expertfs.synth import SynthConfig, synthesize
    g, s = tmp_path / "m.gguf", tmp_path / "m.efs"
    cfg = SynthConfig.tiny(arch)
    synthesize(cfg.replace(quant="q4_0", n_layers=max(3, cfg.n_dense_lead + 3)), str(g))
    repack([str(g)], str(s))
    steps = [5, 17, 300, 42, 7, 99, 512, 3, 64, 1000]
    with Engine.open(str(s), provider="direct") as e:
        want = torch.stack([e.prefill(steps[:1])] + [e.decode(t) for t in steps[1:]])
        one = max(e.store.extent(la, 0).length for la in e.store.layers)
        k = e.config.n_expert_used
    opts = {"warm_start": False, "backend": "buffered", "record_usage": False}
    for slots, staged in ((None, k + 2), (0, 0)):
        with Engine.open(str(s), provider="tiered", ram_bytes=(8 + 2 * (k + 1)) * one,
                         lookahead=True, lookahead_margin=1, prefetch_slots=slots,
                         provider_options=opts) as e:
            got = torch.stack([e.prefill(steps[:1])] + [e.decode(t) for t in steps[1:]])
            assert e.provider.describe()["prefetch_slots"] == staged
            assert e.provider.stats.prefetch_issued > 0
            check_invariants(e.provider)
        assert torch.equal(got, want)
