"""Issue 17 item 6, on a CPU device tier: a get's device misses are not awaited one at a time in
routing order. Every expert already in RAM is uploaded before any read is waited for
(``get_begin`` returns with them while the misses' reads are still held), and the misses are
uploaded in the order their reads land. Reads are held per expert by a gate, so the order is
the test's, not the drive's."""

from __future__ import annotations

import threading
import time

import pytest

from expertfs.runtime.cache import State
from expertfs.runtime.cache.provider import TieredProvider
from expertfs.runtime.io import IOFaultError, RetryPolicy, get_backend
from support.cache_store import (PerReadGate, assert_weights, check_invariants, store_bytes)
from support.faults import Fault, FaultInjectingBackend


def _provider(store, backend, ram=10, vram=6, staging=3):
    slot = max(store.extent(la, 0).length for la in store.layers)
    return TieredProvider(store, ram_bytes=ram * slot, vram_bytes=vram * slot, backend=backend,
                          warm_start=False, record_usage=False, staging_slots=staging)


def _until(cond, limit=30.0):
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def test_ram_hits_upload_before_any_miss_is_awaited_and_misses_land_in_any_order(store):
    data = store_bytes(store)
    gate = PerReadGate()
    with _provider(store, gate) as p:
        assert p.cache.defers and p.cache.device_tier is not None
        p.prefetch(3, [5, 6])                           # into the RAM tier
        _until(lambda: all(p.cache.state_of(p.cache.key(3, e)) is State.HOST for e in (5, 6)))
        for e in (7, 8):
            gate.hold(store.extent(3, e).offset)
        uploads = p.stats.uploads
        ready, finish = p.get_begin(3, [7, 5, 8, 6])     # misses first in routing order
        # returned with both reads still held: the RAM hits are uploaded, none was waited for
        assert sorted(ready) == [5, 6] and p.stats.uploads == uploads + 2
        assert all(p.cache.state_of(p.cache.key(3, e)) is State.DEVICE for e in (5, 6))
        assert_weights(store, data, 3, ready)
        _until(lambda: len(gate.waiting) == 2)           # both misses' reads are in flight
        gate.let_go(store.extent(3, 8).offset)           # the later one lands first ...
        got = finish(some=True)
        assert list(got) == [8]                          # ... and is uploaded first
        assert p.stats.uploads == uploads + 3
        gate.let_go(store.extent(3, 7).offset)
        got = {**got, **finish()}
        assert sorted(got) == [7, 8] and p.stats.uploads == uploads + 4
        assert_weights(store, data, 3, got)
        assert all(p.cache.table.lookup(p.layer_index(3), e) >= 0 for e in (5, 6, 7, 8))
        p.release(3)
        check_invariants(p)
        assert p.stats.misses == 2 and p.stats.hits["ram"] == 2


def test_blocking_get_uploads_every_ram_hit_before_waiting(store):
    """``get`` (wait=True): the uploads of the RAM hits are queued before the first wait, so
    none of them is behind a slow miss that comes earlier in routing order."""
    gate = PerReadGate()
    with _provider(store, gate) as p:
        p.prefetch(2, [1, 2])
        _until(lambda: all(p.cache.state_of(p.cache.key(2, e)) is State.HOST for e in (1, 2)))
        gate.hold(store.extent(2, 0).offset)
        uploads_at_wait = []
        wait_any = p.cache.residency.wait_any

        def spy(entries):
            uploads_at_wait.append(p.stats.uploads)
            gate.let_go(store.extent(2, 0).offset)
            return wait_any(entries)
        p.cache.residency.wait_any = spy
        before = p.stats.uploads
        p.get(2, [0, 1, 2])
        p.release(2)
        assert uploads_at_wait and uploads_at_wait[0] == before + 2
        check_invariants(p)


@pytest.mark.parametrize("blocking", [False, True])
def test_a_failed_miss_gives_its_device_slot_back(store, blocking):
    data = store_bytes(store)
    ext = store.extent(1, 4)
    backend = FaultInjectingBackend(get_backend("buffered"),
                                    [Fault("eio", times=-1, offset=ext.offset)])
    with _provider(store, backend) as p:
        p.reader.handle.retry = RetryPolicy(attempts=1)
        free = p.cache.dev.n_free
        with pytest.raises(IOFaultError):
            if blocking:
                p.get(1, [2, 4, 3])
            else:
                ready, finish = p.get_begin(1, [2, 4, 3])
                finish()
        p.release(1)
        check_invariants(p)
        assert p.cache.state_of(p.cache.key(1, 4)) is State.ABSENT and not p.cache.device_tier.pending
        backend.faults.clear()
        assert_weights(store, data, 1, p.get(1, [2, 4, 3]))
        p.release(1)
        check_invariants(p)
        assert p.cache.dev.n_free == free - 3


def test_an_unfinished_get_begin_is_dropped_at_release(store):
    gate = PerReadGate()
    with _provider(store, gate) as p:
        gate.hold(store.extent(2, 9).offset)
        ready, finish = p.get_begin(2, [9])
        assert not ready and p.cache.device_tier.pending
        threading.Timer(0.2, gate.let_go, (store.extent(2, 9).offset,)).start()
        p.release(2)                                     # the caller never finished it
        assert not p.cache.device_tier.pending
        check_invariants(p)
