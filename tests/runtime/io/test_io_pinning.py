"""Pinning host slabs without a GPU: cudart's register, unregister and last-error calls are
monkeypatched, so the budget split, the error clearing and the warnings run on the CPU."""

from __future__ import annotations

import pytest
import torch

from expertfs.runtime.cache.slots import SlotPool
from expertfs.runtime.io import PAGE, PinBudget
from expertfs.runtime.io import buffers
from expertfs.runtime.io.buffers import HostSlab, PinWarning


@pytest.fixture
def cudart(monkeypatch):
    calls = {"register": [], "unregister": [], "last_error": 0, "reg_err": 0, "unreg_err": 0}

    def register(ptr, n):
        calls["register"].append((ptr, n))
        return calls["reg_err"]

    def unregister(ptr):
        calls["unregister"].append(ptr)
        return calls["unreg_err"]

    def last_error():
        calls["last_error"] += 1
        return 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(buffers, "_cuda_host_register", register)
    monkeypatch.setattr(buffers, "_cuda_host_unregister", unregister)
    monkeypatch.setattr(buffers, "_cuda_get_last_error", last_error)
    return calls


def test_slab_within_budget_is_pinned_whole(cudart):
    budget = PinBudget(1 << 20)
    s = HostSlab(4, PAGE, budget=budget)
    assert s.pinned and s.pinned_slots == 4 and s.pinned_bytes == 4 * PAGE == budget.used
    assert cudart["register"] == [(s.tensor.data_ptr(), 4 * PAGE)]
    s.close()
    assert budget.used == 0 and cudart["unregister"] == [s.tensor.data_ptr()]
    assert cudart["last_error"] == 0


def test_larger_slab_is_pinned_as_far_as_the_budget_goes(cudart):
    budget = PinBudget(3 * PAGE + 100)
    s = HostSlab(8, PAGE, budget=budget)
    assert not s.pinned and s.pinned_slots == 3 and s.pinned_bytes == 3 * PAGE == budget.used
    assert cudart["register"] == [(s.tensor.data_ptr(), 3 * PAGE)]
    assert "3 of 8 slots pinned" in s.pin_note
    rest = HostSlab(2, PAGE, budget=budget)              # the budget is spent
    assert rest.pinned_bytes == 0 and "pin budget" in rest.pin_note
    s.close()
    assert budget.used == 0


def test_failed_register_is_cleared_and_warned(cudart):
    cudart["reg_err"] = 2
    budget = PinBudget(1 << 20)
    with pytest.warns(PinWarning, match="cudaHostRegister of 16384 bytes returned 2"):
        s = HostSlab(4, PAGE, budget=budget)
    assert cudart["last_error"] == 1                     # the pending CUDA error is taken
    assert not s.pinned and s.pinned_bytes == 0 and budget.used == 0
    s.close()
    assert cudart["unregister"] == []


def test_failed_unregister_is_cleared_and_warned(cudart):
    budget = PinBudget(1 << 20)
    s = HostSlab(2, PAGE, budget=budget)
    cudart["unreg_err"] = 712
    with pytest.warns(PinWarning, match="cudaHostUnregister"):
        s.close()
    assert cudart["last_error"] == 1 and budget.used == 0 and s.pinned_bytes == 0
    s.close()                                            # once only
    assert len(cudart["unregister"]) == 1


def test_pool_hands_out_pinned_slots_first(cudart):
    pool = SlotPool("ram", 6, PAGE, device=torch.device("cpu"), host=True, pin="auto",
                    pin_budget=PinBudget(2 * PAGE))
    assert pool.pinned_slots == 2 and pool.pinned_bytes == 2 * PAGE and not pool.pinned
    a, b, c = (pool.alloc(host_write=True) for _ in range(3))
    assert (a, b, c) == (0, 1, 2)
    pool.free(c)
    pool.free(a)
    assert pool.alloc(host_write=True) == 0              # a free pinned slot before pageable
    assert pool.alloc(host_write=True) == 3
    assert pool.n_free == 3                              # 1, 0 and 3 held
    pool.close()


def test_get_last_error_without_cuda_is_harmless():
    assert isinstance(buffers._cuda_get_last_error(), int)
