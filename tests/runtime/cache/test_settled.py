"""A tier is settled (``TierCache.settled``) when every expert a decode step routes to is in
its RAM tier and nothing is queued or read; ``runtime.pool_spin.PoolSpin`` then raises the
native pool's spin, and puts it back at close."""

from __future__ import annotations

import time

import pytest

from expertfs.runtime import kernels
from expertfs.runtime.pool_spin import CHECK_EVERY, RESIDENT_SPIN_US, PoolSpin

from support.cache_store import every_slot as every, tiered as provider


def test_a_tier_is_settled_once_every_expert_is_read(store):
    with provider(store, every(store), warm_start=False) as p:
        assert not p.settled()                                   # nothing read yet
        for layer in store.layers:
            p.get(layer, list(range(store.n_experts(layer))))
            p.release(layer)
        assert p.settled()


def test_the_warm_start_settles_an_uncapped_tier(store):
    with provider(store, every(store), warm_start=True) as p:
        p.resume_warm()
        # A deadline, not a count of turns: between one dripped read landing and the loader
        # issuing the next there is nothing to wait on, and a loop of turns can spin through.
        deadline = time.monotonic() + 60
        while not p.settled() and time.monotonic() < deadline:
            p.cache.residency.wait_any(
                [e for e in p.cache.residency.entries.values() if e.future is not None])
            time.sleep(0.001)
        assert p.settled()


def test_a_capped_tier_never_settles(store):
    with provider(store, every(store) // 3, warm_start=False) as p:
        for layer in store.layers:
            n = store.n_experts(layer)
            for a in range(0, n, 4):
                p.get(layer, list(range(a, min(n, a + 4))))
                p.release(layer)
        assert not p.settled()


class _Provider:
    def __init__(self) -> None:
        self.now = False

    def settled(self) -> bool:
        return self.now


@pytest.mark.skipif(not kernels.available(), reason="the native kernels are not built")
def test_the_pool_spins_longer_once_settled_and_back_at_close():
    before = kernels.status()["spin_us"]
    assert before < RESIDENT_SPIN_US                             # the kernels' default
    spin, prov = PoolSpin(), _Provider()
    for _ in range(2 * CHECK_EVERY):
        spin.step(prov)
    assert kernels.status()["spin_us"] == before                 # reads may still come
    prov.now = True
    for _ in range(CHECK_EVERY - 1):
        spin.step(prov)
    assert kernels.status()["spin_us"] == before                 # looked at every 16th step
    spin.step(prov)
    assert kernels.status()["spin_us"] == RESIDENT_SPIN_US
    spin.close()
    early, prov = PoolSpin(), _Provider()
    prov.now = True
    early.step(prov)                                             # a preloaded tier: step 1
    assert kernels.status()["spin_us"] == RESIDENT_SPIN_US
    early.close()
    spin.close()
    assert kernels.status()["spin_us"] == before
    spin.step(object())                                          # a provider without settled()
    assert kernels.status()["spin_us"] == before
