"""The prompt window (``runtime.cache.window``): while the warm start is held, a RAM tier of every
expert reads the prompt's experts into its spare slots, for their get only, and leaves each
expert's own read queued for the warm start."""

from __future__ import annotations

import pytest

from expertfs.runtime.cache import State
from expertfs.runtime.cache.sizing import WINDOW_ENV, window_slots

from support.cache_store import assert_weights, every_slot, store_bytes, tiered


def _ram(store, spare: int) -> int:
    """A tier of every expert and ``spare`` slots more."""
    n = sum(store.n_experts(la) for la in store.layers)
    return every_slot(store) // (n + 2) * (n + spare)


def _window(store):
    return tiered(store, _ram(store, 8), warm_start=True, warm_held=True)


@pytest.fixture(autouse=True)
def _asked_for(monkeypatch):
    """The window is opt-in (``WINDOW_ENV``)."""
    monkeypatch.setenv(WINDOW_ENV, "1")


def test_spare_slots_lend_the_prompt_its_reads_and_leave_the_warm_start_its_own(store):
    data = store_bytes(store)
    with _window(store) as p:
        cache = p.cache
        assert cache.window.open and cache.window.n_spare == 8
        layer = store.layers[0]
        assert p.max_experts_per_get == 8                    # the prompt's gets: the spare slots
        got = p.get(layer, list(range(8)))
        assert_weights(store, data, layer, got)              # the same bytes, from spare slots
        own = [cache.residency.entries[cache.key(layer, e)] for e in range(8)]
        assert all(e.state is State.LOADING and not cache.loader.started(e) for e in own)
        li = cache.geo.index_of()[layer]
        assert all(cache.table.lookup(li, e) < 0 for e in range(8))   # nothing maps the lent
        p.release(layer)
        assert not cache.window.taken and cache.host.n_free == 8     # given back


def test_the_window_closes_when_the_warm_start_resumes(store):
    data = store_bytes(store)
    with _window(store) as p:
        p.resume_warm()
        assert not p.cache.window.open
        layer = store.layers[1]
        got = p.get(layer, [0, 1])                           # promoted into their own slots
        assert_weights(store, data, layer, got)
        assert all(p.cache.residency.entries[p.cache.key(layer, e)].state is State.HOST
                   for e in (0, 1))
        p.release(layer)


def test_a_full_window_promotes_the_rest(store):
    """More experts than spare slots in one get: the rest are read into their own slots."""
    data = store_bytes(store)
    with _window(store) as p:
        layer = store.layers[2]
        got = p.get(layer, list(range(12)))
        assert_weights(store, data, layer, got)
        own = [p.cache.residency.entries[p.cache.key(layer, e)].state for e in range(12)]
        assert own.count(State.HOST) == 4
        p.release(layer)
        assert p.cache.host.n_free == 8


def test_no_spare_slots_no_window(store, monkeypatch):
    with tiered(store, _ram(store, 0), warm_start=True, warm_held=True) as p:
        assert not p.cache.window.open
        assert p.max_experts_per_get == sum(store.n_experts(la) for la in store.layers)
    monkeypatch.delenv(WINDOW_ENV)                                     # or not asked for
    with _window(store) as p:
        assert not p.cache.window.open


def test_window_slots_are_at_least_two_layers_of_routes_at_most_a_layer():
    assert window_slots(4 << 20, 8, 288) == 64               # 256 MiB of 4 MiB experts
    assert window_slots(64 << 20, 8, 288) == 16              # 2 k
    assert window_slots(1 << 10, 8, 128) == 128              # one layer's every expert
