"""The cache mechanism's parts: slot pools within budgets, sizing, the slot table, the copier,
the loader's warm drip, and learned usage persisted in a real store (merged, atomic)."""

from __future__ import annotations

import pytest
import torch

from expertfs.errors import StoreError, UsageError
from expertfs.runtime.cache.usage import DYNAMICS
from expertfs.runtime.cache import (Copier, SlotGeometry, SlotPool, SlotTable, UsageRecorder,
                                    load_rates, persist_usage, plan_slots)
from expertfs.runtime.io import PAGE, PinBudget
from expertfs.store.reader import Store

from support.cache_store import K, N_EXPERTS, make_store

CPU = torch.device("cpu")


def test_geometry_from_store(store):
    g = SlotGeometry.from_store(store)
    assert g.layers == (1, 2, 3) and g.experts == (N_EXPERTS,) * 3 and g.k == K
    largest = max(store.extent(la, e).length for la in store.layers for e in range(N_EXPERTS))
    assert g.slot_bytes == largest and g.stride % PAGE == 0
    assert g.layer_of(2 * N_EXPERTS + 5) == 2


def test_host_pool_slots_aligned_disjoint_and_within_budget():
    budget = PinBudget(1 << 30)
    pool = SlotPool("ram", 5, 3 * PAGE + 100, device=CPU, host=True, pin="auto", pin_budget=budget)
    try:
        cuda = torch.cuda.is_available()                    # pinned with CUDA only, in budget
        assert pool.pinned == cuda and budget.used == (pool.nbytes if cuda else 0)
        assert pool.stride == 4 * PAGE and pool.nbytes == 5 * 4 * PAGE
        ptrs = [pool.view(i).data_ptr() for i in range(5)]
        assert all(p % PAGE == 0 for p in ptrs)
        assert sorted(ptrs) == [ptrs[0] + i * pool.stride for i in range(5)]
        assert pool.rows().shape == (5, pool.stride)
        got = [pool.alloc(host_write=True) for _ in range(6)]
        assert got[:5] == [0, 1, 2, 3, 4] and got[5] is None
        pool.free(3)
        assert pool.alloc(host_write=True) == 3
    finally:
        pool.close()


def test_device_pool_on_cpu():
    pool = SlotPool("vram", 3, PAGE, device=CPU, host=False)
    assert pool.tensor.device.type == "cpu" and pool.view(2).data_ptr() % PAGE == 0
    assert pool.n_free == 3


def test_plan_slots_budgets(store):
    g = SlotGeometry.from_store(store)
    s = plan_slots(g, 10 * g.stride + 5, 0, queue_depth=8)
    assert (s.host, s.staging, s.ram, s.vram, s.compute) == (10, 0, 10, 0, 10)
    s = plan_slots(g, 12 * g.stride, 6 * g.stride, queue_depth=8)
    assert s.staging == min(8, K) + 1 and s.ram == 12 - s.staging and s.vram == 6
    s = plan_slots(g, 6 * g.stride, 6 * g.stride, queue_depth=8)   # too small for a RAM tier
    assert (s.staging, s.ram) == (6, 0)
    s = plan_slots(g, 12 * g.stride, 6 * g.stride, queue_depth=8, staging=2)
    assert (s.staging, s.ram) == (2, 10)
    # prefetch slots (one tier only) come out of the RAM budget, at most half of it
    s = plan_slots(g, 20 * g.stride, 0, queue_depth=8, prefetch=6)
    assert (s.host, s.ram, s.prefetch, s.compute) == (20, 14, 6, 14)
    assert plan_slots(g, 20 * g.stride, 0, queue_depth=8, prefetch=50).prefetch == 10
    total = sum(g.experts)                        # all experts fit: nothing to predict
    assert plan_slots(g, (total + 5) * g.stride, 0, queue_depth=8, prefetch=6).prefetch == 0
    assert plan_slots(g, 12 * g.stride, 6 * g.stride, queue_depth=8, prefetch=6).prefetch == 0
    with pytest.raises(UsageError, match="holds no expert"):
        plan_slots(g, g.stride - 1, 0, queue_depth=8)
    with pytest.raises(UsageError, match="VRAM budget"):
        plan_slots(g, 10 * g.stride, 100, queue_depth=8)
    with pytest.raises(UsageError, match="staged in RAM"):
        plan_slots(g, 0, 10 * g.stride, queue_depth=8)
    # a decode step holds a layer's k experts at once: a tier of fewer is refused up front
    # (it used to fail at the first token, a CapacityError out of the cache)
    with pytest.raises(UsageError, match=f"holds {K - 1} experts.*uses {K} of a layer"):
        plan_slots(g, (K - 1) * g.stride, 0, queue_depth=8)
    with pytest.raises(UsageError, match=f"VRAM budget .* holds {K - 1} experts"):
        plan_slots(g, 20 * g.stride, (K - 1) * g.stride, queue_depth=8)
    assert plan_slots(g, K * g.stride, 0, queue_depth=8).compute == K


def test_slot_table_cpu_is_one_array():
    copier = Copier(CPU)
    t = SlotTable(3, 8, CPU, copier)
    assert t.row(1).tolist() == [-1] * 8
    t.set_now(1, 5, 7)
    assert t.lookup(1, 5) == 7 and int(t.device[1, 5]) == 7
    t.clear(1, 5)
    assert t.lookup(1, 5) == -1 and int(t.row(1)[5]) == -1
    t.clear(1, 5)                                       # clearing an absent entry is a no-op


def test_copier_cpu_copies_now_and_runs_then():
    c = Copier(CPU)
    src = torch.arange(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    ran = []
    assert c.copy(dst, src, then=lambda: ran.append(1)) is None
    assert torch.equal(dst, src) and ran == [1]
    assert c.compute_mark() is None
    t, ev = c.transient(src)
    assert t is src and ev is None
    c.compute_wait(None)
    c.synchronize()


@pytest.mark.nogpu
def test_copier_refuses_cuda_without_cuda():
    with pytest.raises(UsageError, match="CUDA is not available"):
        Copier(torch.device("cuda"))


def test_usage_recorder_counts_and_take():
    u = UsageRecorder()
    u.add(1, [3, 4])
    u.add(1, [3])
    assert u.counts == {(1, 3): 2, (1, 4): 1} and len(u) == 2
    assert u.take() == ({(1, 3): 2, (1, 4): 1}, dict.fromkeys(DYNAMICS, 0)) and len(u) == 0


def test_usage_recorder_counts_how_a_run_reuses_experts():
    """With top-k given, a call of at most k experts is a decoded token's route: each expert
    is reused when the run (its prompt included) routed to it at that layer before, and kept
    when the previous decoded token at that layer routed to it; ``seen`` adds, per route and
    expert, how many experts the run had routed to at that layer before (chance's reuse)."""
    u = UsageRecorder(k=2)
    u.add(1, [0, 1, 2, 3])                # a prompt's union: seen, not counted
    u.add(1, [3, 5])                      # a token: 3 reused, 5 new; nothing before to keep
    u.add(2, [3])                         # another layer: new there
    u.add(1, [5, 0])                      # both reused, 5 kept
    counts, dyn = u.take()
    none = dict.fromkeys(("prompt_layers", "prompt_tokens", "prompt_experts"), 0)
    assert dyn == {"routes": 5, "reused": 3, "follows": 2, "kept": 1,
                   "seen": 2 * 4 + 1 * 0 + 2 * 5, "seen_routes": 5, **none} and counts[(1, 3)] == 2
    u.add(1, [1, 2, 5])                   # a prompt again: the next token follows no token
    u.add(1, [1])                         # the run goes on: what it saw still counts
    assert u.take()[1] == {**none, "routes": 1, "reused": 1, "follows": 0, "kept": 0, "seen": 5,
                           "seen_routes": 1}


def test_usage_persists_merged_while_the_store_is_open(store):
    assert store.index.usage() == {}
    persist_usage(store, {(1, 3): 2, (2, 0): 5})
    persist_usage(store, {(1, 3): 1, (3, 15): 4}, {"routes": 8, "reused": 6, "kept": 0})
    persist_usage(store, {(1, 3): 1}, {"routes": 8, "reused": 2})
    assert store.index.usage() == {(1, 3): 4, (2, 0): 5, (3, 15): 4}
    assert store.index.usage_dynamics() == {"routes": 16, "reused": 8}
    rates = load_rates(store, K)
    assert set(rates) == {(1, 3), (2, 0), (3, 15)}
    assert rates[(2, 0)] == pytest.approx(K)          # the only expert its layer used
    persist_usage(store, {})                           # nothing to write: no child process


def test_usage_persist_failure_is_a_store_error(tmp_path):
    class NotAStore:
        path = str(tmp_path / "missing")
    with pytest.raises(StoreError, match="could not record expert usage"):
        persist_usage(NotAStore(), {(1, 1): 1})


def test_fixture_store_geometry(tmp_path):
    store = Store.open(str(make_store(tmp_path)))
    try:
        assert store.layers == [1, 2, 3]
        lengths = {store.extent(la, 0).length for la in store.layers}
        assert len(lengths) == 2                  # slots must fit the largest extent
    finally:
        store.close()


def test_device_slot_table_batches_non_blocking_writes():
    """On a device (torch's meta device here) a set is one non-blocking copy of a host batch and
    one index_copy_, never an indexing assignment from a scalar (a blocking copy on CUDA); a
    clear is only recorded, and written with the next set."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append((str(func.overloadpacket), dict(kwargs or {})))
            return func(*args, **(kwargs or {}))

    t = SlotTable(3, 8, torch.device("meta"), Copier(CPU))
    assert t.device.device.type == "meta" and not t._shared
    with Ops() as rec:
        t.clear(1, 5)                                   # absent: nothing
        t.set_now(1, 5, 7)
        t.clear(1, 5)
        assert t.pending == 1
        t.set_now(2, 3, 4)
    names = [n for n, _ in rec.ops]
    assert names.count("aten.index_copy_") == 2 and t.writes == 2 and t.pending == 0
    assert not {"aten.fill_", "aten.index_put_", "aten.copy_"} & set(names), names
    moves = [kw for n, kw in rec.ops if n == "aten._to_copy" and kw.get("device") is not None]
    assert len(moves) == 2 and all(kw.get("non_blocking") for kw in moves)
    assert t.lookup(1, 5) == -1 and t.lookup(2, 3) == 4


def test_mirrored_slot_table_contents():
    t = SlotTable(2, 4, CPU, Copier(CPU), mirror=True)
    t.set_now(0, 1, 3)
    t.set_now(1, 2, 0)
    t.clear(0, 1)
    assert int(t.device[0, 1]) == 3                     # not yet: waits for the next flush
    t.set_now(0, 0, 3)                                  # the freed slot's upload
    assert t.device.tolist() == [[3, -1, -1, -1], [-1, -1, 0, -1]] == t.host.tolist()
