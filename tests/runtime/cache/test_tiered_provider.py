"""TieredProvider on a real (tiny) store: the bytes of every path equal the store's (miss, RAM hit,
VRAM hit on a CPU device tier, prefetched, joined), budgets and invariants hold under pressure,
held experts are never evicted, stale prefetches are cancelled, failures leave it consistent,
usage round-trips through the store into a warm start, and hit counts equal the simulator's."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest

from expertfs.errors import UsageError
from expertfs.runtime.cache import State
from expertfs.runtime.cache.entry import Entry
from expertfs.runtime.cache.loader import Loader
from expertfs.runtime.experts import ExpertProvider
from expertfs.runtime.cache.provider import TieredProvider
from expertfs.runtime.io import IOFaultError, Priority, RetryPolicy, get_backend
from expertfs.runtime.io.scheduler import ReadFuture
from expertfs.runtime.policies.base import CapacityError
from expertfs.store.reader import Store
from support.faults import Fault, FaultInjectingBackend

from support.cache_store import (K, N_EXPERTS, GatedBackend, PerReadGate, assert_weights,
                                check_invariants, make_store, store_bytes)


@pytest.fixture
def data(store):
    return store_bytes(store)


def wait_for(cond, limit_s=30.0):
    """Poll until ``cond()`` (a worker thread has to get there); fails after ``limit_s``."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


def slot(store):
    return max(store.extent(la, 0).length for la in store.layers)


def provider(store, ram, vram=0, **kw):
    kw.setdefault("backend", "buffered")
    kw.setdefault("warm_start", False)
    kw.setdefault("record_usage", False)
    return TieredProvider(store, ram_bytes=ram * slot(store), vram_bytes=vram * slot(store), **kw)


def test_is_an_expert_provider(store):
    with provider(store, 8) as p:
        assert isinstance(p, ExpertProvider)
        d = p.describe()
        assert d["ram_slots"] == 8 and d["vram_slots"] == 0 and not d["pinned"]


def test_host_tier_miss_then_hit_bytes_equal(store, data):
    with provider(store, 8) as p:
        w = p.get(1, [0, 5, 9])
        assert_weights(store, data, 1, w)
        p.release(1)
        assert p.stats.misses == 3 and p.stats.hits.get("ram", 0) == 0
        w = p.get(1, [5, 9, 2])
        assert_weights(store, data, 1, w)
        p.release(1)
        assert p.stats.hits["ram"] == 2 and p.stats.misses == 4
        assert p.stats.bytes_read == sum(store.extent(1, e).length for e in (0, 5, 9, 2))
        check_invariants(p)
        # the forward pass may gather by slot: the CPU slot table maps the host slab
        li = p.layer_index(1)
        row = p.slot_table[li]
        for e in (0, 5, 9, 2):
            s = int(row[e])
            n = store.extent(1, e).length
            off = store.extent(1, e).offset
            assert bytes(p.compute_slab[s, :n].numpy()) == data[off:off + n]


def test_cpu_device_tier_every_path(store, data):
    with provider(store, 10, vram=4, staging_slots=3) as p:
        assert p.describe()["vram_slots"] == 4 and p.describe()["ram_slots"] == 7
        rng = random.Random(1)
        for _ in range(40):
            layer = rng.choice(store.layers)
            ids = rng.sample(range(N_EXPERTS), K)
            assert_weights(store, data, layer, p.get(layer, ids))
            p.release(layer)
            check_invariants(p)
        st = p.stats
        assert st.hits.get("vram", 0) > 0 and st.hits.get("ram", 0) > 0 and st.misses > 0
        assert st.demotions > 0 and st.bytes_d2h > 0
        assert st.uploads == st.hits["ram"] + st.misses
        # device hit: the same experts again come from VRAM
        ids = [e for e in range(N_EXPERTS) if p.cache.table.lookup(0, e) >= 0][:K]
        before = st.hits["vram"]
        assert_weights(store, data, 1, p.get(1, ids))
        p.release(1)
        assert st.hits["vram"] == before + len(ids)


def test_budgets_hold_and_held_experts_survive_pressure(store, data):
    with provider(store, 10, vram=6, staging_slots=2) as p:
        held = p.get(2, [1, 2, 3, 4])                  # layer 2 runs ... and is not released
        rng = random.Random(7)
        for _ in range(30):
            layer = rng.choice([1, 3])
            p.get(layer, rng.sample(range(N_EXPERTS), 2))
            p.release(layer)
            check_invariants(p)
        assert_weights(store, data, 2, held)           # views still hold layer 2's bytes
        p.release(2)
    with provider(store, 6) as p:
        held = p.get(3, [0, 1, 2, 3])
        for i in range(12):
            p.get(1, [i % N_EXPERTS, (i + 7) % N_EXPERTS])
            p.release(1)
        assert_weights(store, data, 3, held)
        p.release(3)
        check_invariants(p)


def test_more_than_the_tier_holds_is_refused(store):
    with provider(store, 4) as p:
        with pytest.raises(CapacityError, match="compute tier has 4 slots"):
            p.get(1, list(range(5)))
        p.get(1, [0, 1])
        with pytest.raises(CapacityError):
            p.get(2, [0, 1, 2])                          # 2 of layer 1 are still held
        p.release(1)
        p.get(2, [0, 1, 2])
        p.release(2)
        with pytest.raises(UsageError, match="no routed experts"):
            p.get(0, [0])
        with pytest.raises(UsageError, match="outside layer"):
            p.get(1, [N_EXPERTS])
        check_invariants(p)


def test_prefetched_expert_is_a_hit(store, data):
    with provider(store, 10) as p:
        p.prefetch(2, [3, 7])
        for e in (3, 7):
            key = p.cache.key(2, e)
            fut = p.cache.entries[key].future
            if fut is not None:
                fut.result()
        p.get(1, [0])                                    # drains completions
        p.release(1)
        assert_weights(store, data, 2, p.get(2, [3, 7, 8]))
        p.release(2)
        st = p.stats
        assert st.prefetch_issued == 2 and st.prefetch_used == 2 and st.hits["ram"] == 2
        rep = p.prefetch_report()["gate"]
        assert rep["covered"] == 2 and rep["requested"] == 3 and rep["coverage"] == pytest.approx(2 / 3)
        check_invariants(p)


def test_demand_joins_an_in_flight_prefetch(store, data):
    gate = GatedBackend()
    with provider(store, 10, backend=gate, queue_depth=1) as p:
        p.prefetch(2, [3])
        resolve = p.cache.loader.resolve
        calls = []

        def resolve_then_open(e):
            calls.append(e.key)
            fut = resolve(e)
            if len(calls) == 2:                          # joined (1st), now waiting (2nd)
                gate.release.set()
            return fut
        p.cache.loader.resolve = resolve_then_open
        assert_weights(store, data, 2, p.get(2, [3]))
        p.release(2)
        n = store.extent(2, 3).length
        assert p.stats.joined == 1 and p.stats.late_bytes == n and p.stats.misses == 0
        rep = p.prefetch_report()["gate"]
        assert rep["late"] == 1 and rep["late_bytes"] == n and rep["covered"] == 0
        check_invariants(p)


def test_stale_prefetches_are_cancelled_not_waited_for(store, data):
    gate = GatedBackend()
    with provider(store, 12, backend=gate, queue_depth=1, max_in_flight=4) as p:
        gate.release.set()
        p.get(1, [0])                                    # the cursor is at layer 1
        p.release(1)
        gate.release.clear()
        gate.started.clear()
        p.prefetch(2, [4, 5, 6])                         # 4 runs (held by the gate); 5, 6 queue
        wait_for(lambda: gate.started)
        wasted = p.prefetcher.on_wasted

        def on_wasted(source, nbytes, cancelled):
            wasted(source, nbytes, cancelled)
            gate.release.set()                              # free the worker once cancelled
        p.prefetcher.on_wasted = on_wasted
        p.cache.listener = p.prefetcher
        assert_weights(store, data, 2, p.get(2, [9]))    # layer 2 runs without 4, 5, 6
        p.release(2)
        st = p.stats
        assert st.prefetch_cancelled == 2 and st.prefetch_wasted == 2
        assert p.prefetch_report()["gate"]["cancelled"] == 2
        assert not any(p.cache.state_of(p.cache.key(2, e)) is not State.ABSENT for e in (5, 6))
        check_invariants(p)


def test_failed_read_raises_and_leaves_it_consistent(store, data):
    ext = store.extent(3, 2)
    backend = FaultInjectingBackend(get_backend("buffered"),
                                    [Fault("eio", times=-1, offset=ext.offset)])
    with provider(store, 6, backend=backend) as p:
        p.reader.handle.retry = RetryPolicy(attempts=1)
        with pytest.raises(IOFaultError):
            p.get(3, [1, 2])
        check_invariants(p)
        assert p.cache.n_held == 0 and p.cache.state_of(p.cache.key(3, 2)) is State.ABSENT
        backend.faults.clear()
        assert_weights(store, data, 3, p.get(3, [1, 2]))
        p.release(3)
        check_invariants(p)


def test_a_failed_get_takes_its_other_reads_outcome_first(store, data):
    """A get that raises while another of its reads is still in flight waits for that read
    before the error leaves it: one that fails too leaves nothing behind, so the next get
    reads the expert again (the fault gone by then) instead of joining a read that fails and
    inheriting its error (a persistent fault once did that to the next request under load)."""
    e1, e2 = store.extent(3, 1), store.extent(3, 2)
    faulty = FaultInjectingBackend(get_backend("buffered"), [Fault("eio", times=-1, offset=e1.offset),
                                                             Fault("eio", times=-1, offset=e2.offset)])
    gate = PerReadGate()
    gate.inner = faulty                                   # held first, then the fault
    gate.hold(e1.offset)
    with provider(store, 6, backend=gate) as p:
        p.reader.handle.retry = RetryPolicy(attempts=1)
        timer = threading.Timer(0.3, gate.let_go, [e1.offset])
        timer.start()
        with pytest.raises(IOFaultError):
            p.get(3, [2, 1])                              # (3, 2) fails while (3, 1) is held
        timer.join()
        assert p.cache.state_of(p.cache.key(3, 1)) is State.ABSENT
        check_invariants(p)
        faulty.faults.clear()
        assert_weights(store, data, 3, p.get(3, [2, 1]))
        p.release(3)
        check_invariants(p)


def test_usage_round_trip_and_warm_start(store_path, data):
    s = Store.open(str(store_path))
    try:
        with provider(s, 6, record_usage=True) as p:
            for _ in range(5):
                p.get(1, [2, 3])
                p.release(1)
            p.get(2, [7])
            p.release(2)
        assert s.index.usage() == {(1, 2): 5, (1, 3): 5, (2, 7): 1}
        with provider(s, 6, warm_start=True) as p:
            assert p.stats.warm_issued == 3
            for key in list(p.cache.entries):
                e = p.cache.entries[key]
                if e.state is State.LOADING:
                    p.cache.loader.resolve(e).result()
            got = p.get(1, [2, 3])
            assert_weights(s, data, 1, got)
            p.release(1)
            assert p.stats.hits["ram"] == 2 and p.stats.misses == 0
            check_invariants(p)
    finally:
        s.close()


def test_warm_start_loads_every_expert_when_all_fit(store, data):
    """A fresh store (no usage yet) and a RAM tier that holds the whole model: warm start loads
    every routed expert, so decoding never waits on the disk (as a cached mmap would not)."""
    n = sum(store.n_experts(la) for la in store.layers)
    with provider(store, n + 8, warm_start=True) as p:
        assert p.stats.warm_issued == n
        for e in list(p.cache.entries.values()):
            if e.state is State.LOADING:
                p.cache.loader.resolve(e).result()
        for la in store.layers:
            assert_weights(store, data, la, p.get(la, list(range(K))))
            p.release(la)
        assert p.stats.misses == 0
    with provider(store, n // 2, warm_start=True) as p:      # does not fit: the learned ones only
        assert p.stats.warm_issued == len(store.index.usage())


def test_warm_start_leaves_the_nextn_block_to_its_learned_usage(tmp_path):
    """A RAM tier that holds the whole model: warm start loads every expert of the decoder's
    layers but none of the NextN block's, which only speculative drafts route through (learned
    usage of them, from runs with drafts, brings them in)."""
    s = Store.open(str(make_store(tmp_path, n_nextn=1)))
    try:
        nextn = [la for la in s.layers if s.layer_info(la)["nextn"]]
        assert len(nextn) == 1
        decode = [la for la in s.layers if la not in nextn]
        n = sum(s.n_experts(la) for la in s.layers)
        with provider(s, n + 8, warm_start=True) as p:
            assert p.stats.warm_issued == sum(s.n_experts(la) for la in decode)
            li = p.cache._index[nextn[0]]
            assert not [k for k in p.cache.entries if k // p.cache._E == li]
        with provider(s, 4, record_usage=True) as p:       # a draft's get of a NextN expert
            p.get(nextn[0], [3])
            p.release(nextn[0])
        with provider(s, n + 8, warm_start=True) as p:
            assert p.stats.warm_issued == sum(s.n_experts(la) for la in decode) + 1
    finally:
        s.close()


class _HeldReader:
    """An ExpertReader stand-in whose reads complete only when the test says so."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, ReadFuture]] = []

    def read_expert(self, layer, expert, *, into, priority):
        fut = ReadFuture(priority)
        self.reads.append((expert, fut))
        return fut


def test_warm_drip_waits_while_demand_reads_are_in_flight():
    """The drip keeps ``depth`` warm reads in flight but issues none while a demand read is
    (a warm read at the drive shares its bandwidth); the last demand read's completion
    resumes it; after close nothing more is issued."""
    reader = _HeldReader()
    loader = Loader(reader, lambda slot: None, depth=2)
    entries = [Entry(key=k, layer=1, expert=k, extent=None, host_slot=k) for k in range(6)]
    loader.queue_warm(entries[:5])
    assert [x for x, _ in reader.reads] == [0, 1]
    loader.issue(entries[5], Priority.DEMAND)
    reader.reads[0][1].set_result(None)                 # a warm read ends: demand in flight
    assert len(reader.reads) == 3 and loader.drip_pending == 4
    reader.reads[2][1].set_result(None)                 # the demand read ends: the drip resumes
    assert [x for x, _ in reader.reads[3:]] == [2]      # back to two warm reads in flight
    loader.close()
    for _, f in reader.reads[1:]:
        if not f.done():
            f.set_result(None)
    assert len(reader.reads) == 4


def test_predictions_drip_ahead_of_warm_reads_and_yield_to_demand():
    """Predictions go through the drip too, ahead of queued warm reads: one background read at
    a time, none while a demand read is in flight; ``hold`` stops warm reads only; a queued
    prediction is dropped unread by ``unqueue`` or issued at demand priority by ``resolve``."""
    reader = _HeldReader()
    loader = Loader(reader, lambda slot: None, depth=1)
    e = [Entry(key=k, layer=1, expert=k, extent=None, host_slot=k) for k in range(7)]
    loader.hold()
    loader.queue_warm(e[:2])
    assert reader.reads == []                           # held: no warm read
    loader.queue_prefetch(e[2])
    assert [x for x, _ in reader.reads] == [2]          # a prediction goes while warm reads wait
    loader.go()
    loader.queue_prefetch(e[3])
    loader.queue_prefetch(e[4])
    loader.queue_prefetch(e[5])
    assert len(reader.reads) == 1                       # one background read at a time
    loader.issue(e[6], Priority.DEMAND)
    reader.reads[0][1].set_result(None)                 # the prediction ends, a demand is in flight
    assert [x for x, _ in reader.reads] == [2, 6]
    assert loader.unqueue(e[3]) and not loader.started(e[3]) and not loader.unqueue(e[3])
    fut = loader.resolve(e[5])                          # needed now: issued at demand priority
    assert fut.priority == Priority.DEMAND and loader.started(e[5])
    reader.reads[1][1].set_result(None)
    assert len(reader.reads) == 3                       # the other demand read is in flight
    fut.set_result(None)                                # demands done: the prediction before warm
    assert [x for x, _ in reader.reads[3:]] == [4]
    reader.reads[3][1].set_result(None)
    assert [x for x, _ in reader.reads[4:]] == [0]      # then the warm start
    assert loader.drip_pending == 2
    loader.close()
    reader.reads[4][1].set_result(None)
    assert len(reader.reads) == 5


def test_a_dropped_prediction_queued_again_is_read_into_the_new_entry_only():
    """A queued prediction dropped unread (its slot freed) and its expert predicted again (a new
    entry, another slot) leaves the old entry behind in the drip's queue: the drip must issue the
    new entry once and never the old one, whose slot may by then hold another expert."""
    reader = _HeldReader()
    slots: list[int] = []
    loader = Loader(reader, lambda slot: slots.append(slot), depth=1)
    busy = Entry(key=0, layer=1, expert=0, extent=None, host_slot=0)
    loader.queue_prefetch(busy)                         # the drip's one read in flight
    old = Entry(key=5, layer=1, expert=5, extent=None, host_slot=1)
    loader.queue_prefetch(old)
    assert loader.unqueue(old)                          # dropped unread: slot 1 is free again
    new = Entry(key=5, layer=1, expert=5, extent=None, host_slot=2)
    loader.queue_prefetch(new)
    assert not loader.unqueue(old) and not loader.started(new)
    reader.reads[0][1].set_result(None)                 # the drip moves on
    assert slots == [0, 2] and old.future is None and new.future is reader.reads[1][1]
    assert loader.started(new) and loader.drip_pending == 1
    reader.reads[1][1].set_result(None)
    assert len(reader.reads) == 2 and loader.drip_pending == 0
    loader.close()


def test_closing_with_warm_reads_in_flight_issues_no_more(store, caplog):
    n = sum(store.n_experts(la) for la in store.layers)
    backend = FaultInjectingBackend(get_backend("buffered"),
                                    [Fault("delay", times=-1, delay_s=0.02)])
    with caplog.at_level(logging.ERROR):
        with provider(store, n + 8, warm_start=True, backend=backend) as p:
            time.sleep(0.05)
            assert p.cache.loader.drip_pending > 0          # warm reads in flight at close
        time.sleep(0.1)
    assert not [r for r in caplog.records if "callback" in r.getMessage()]


def test_demotion_into_a_ram_tier_pinned_full_drops_instead(store, data):
    """A get whose own experts fill the RAM tier (a prefill batch's union): the device victim
    cannot be demoted (every RAM slot pinned), so it is dropped; bytes and invariants hold."""
    with provider(store, 7, vram=14, staging_slots=3, policy="lru") as p:
        assert p.describe()["ram_slots"] == 4
        for layer, ids in ((2, [0, 1, 2, 3]), (1, list(range(10))), (1, [10, 11, 12, 13])):
            p.get(layer, ids)
            p.release(layer)
        ram = [e.expert for e in p.cache.entries.values() if e.dev_slot < 0]
        assert sorted(ram) == [0, 1, 2, 3]                    # layer 2's four were demoted
        assert_weights(store, data, 2, p.get(2, [8, 0, 1, 2, 3]))
        p.release(2)
        st = p.stats
        assert st.evictions["vram"] - st.demotions == 1       # one victim dropped, not demoted
        check_invariants(p)
        assert_weights(store, data, 3, p.get(3, list(range(14))))
        p.release(3)
        check_invariants(p)


def test_prefetch_hints_never_raise_for_layers_without_experts(store):
    with provider(store, 8) as p:
        p.prefetch(0, [1, 2])                    # the leading dense block: nothing to do
        assert p.stats.prefetch_issued == 0
        assert p.max_experts_per_get == 8
        p.get(1, [0, 1])
        assert p.max_experts_per_get == 6
        p.release(1)
        p.close()
        p.prefetch(1, [3])                       # after close: ignored


def test_the_ram_tier_is_faulted_in_ahead_only_where_the_reads_cycle_through_it(store):
    """The host slab's background fault-in (HostSlab's Prefault) runs for a RAM tier smaller
    than the store's experts (under a cap the prompt's reads fill and reuse all of it) and not
    for one with a slot for every expert (no cap: faulting in what no read has reached yet
    would take the prompt's CPU); either way the experts asked for are served."""
    total = sum(store.n_experts(la) for la in store.layers)
    for ram, ahead in ((4, True), (total, False)):
        p = provider(store, ram=ram)
        try:
            assert (p.cache.host._slab._prefault is not None) is ahead, ram
            la = store.layers[0]
            got = p.get(la, [0, 1])
            assert sorted(got) == [0, 1]
        finally:
            p.close()


def test_a_prompt_teaches_the_store_how_much_of_a_layer_it_touches(tmp_path):
    """``Engine.prefill`` counts its prompt in the usage recorder (``prompt_coverage``): per MoE
    layer, the prompt's tokens and the distinct experts its batches touched, persisted with
    the run's usage for ``plan``'s first token (``plan.routing.learned_coverage``)."""
    from expertfs.runtime.engine import Engine
    from support.cache_store import tiny_store

    path = tiny_store(tmp_path)
    with Store.open(path) as st:
        slot = max(st.extent(la, 0).length for la in st.layers)
    prompt = [3, 17, 40, 2, 9, 11, 5]
    with Engine.open(path, provider="tiered", ram_bytes=64 * slot, prefill_batch=3,
                     provider_options={"warm_start": False, "backend": "buffered",
                                       "record_usage": True}) as e:
        e.prefill(prompt)
    with Store.open(path) as st:
        d, usage = st.index.usage_dynamics(), st.index.usage()
    layers = {la for la, _ in usage}
    assert layers and d["prompt_layers"] == len(layers)
    assert d["prompt_tokens"] == len(prompt) * len(layers)
    assert d["prompt_experts"] == len(usage)              # each (layer, expert) the prompt's
    # plan takes the coverage of one prompt, before the usage is long enough to price decode
    from expertfs.runtime.plan.model import load_geometry
    from expertfs.runtime.plan.run import learned_usage
    g, _ = load_geometry(str(path))
    learned, dynamics, coverage, _ = learned_usage(str(path), g)
    assert learned == {} and dynamics is None
    assert coverage.tokens == len(prompt) and coverage.touched(len(prompt)) == pytest.approx(
        len(usage) / len(layers), abs=0.01)
