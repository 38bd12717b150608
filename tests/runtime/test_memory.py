"""Memory limits and the default RAM tier (cgroup caps count; the trunk is left room)."""

from __future__ import annotations

from expertfs.runtime import memory
from expertfs.runtime.cache.sizing import SlotGeometry, plan_slots


def test_default_tier_leaves_room_for_trunk_and_runtime(monkeypatch):
    monkeypatch.setattr(memory, "physical_memory", lambda: 32 << 30)
    # the machine's RAM: the OS keeps an eighth of it (4 GiB of 32)
    big = memory.default_ram_tier(1 << 30, limit=32 << 30, source="physical")
    assert big == (28 << 30) - (1 << 30) - memory.RUNTIME_OVERHEAD
    assert memory.default_ram_tier(1 << 30, limit=32 << 30, cap=4 << 30) == 4 << 30
    small = memory.default_ram_tier(1 << 30, limit=2 << 30)                       # a 2 GiB cap
    assert small == (2 << 30) - (1 << 30) - memory.RUNTIME_OVERHEAD
    assert memory.default_ram_tier(3 << 30, limit=2 << 30) == 64 << 20            # floor
    # bounded by the experts there are (and a GPU run's staging slots)
    assert memory.default_ram_tier(1 << 30, limit=8 << 30, experts=1 << 30, staging=5) == \
        (1 << 30) + 5


def test_budget_warning_names_a_fitting_size():
    assert memory.check_budget(1 << 30, 1 << 30, limit=4 << 30) is None
    w = memory.check_budget(2 << 30, 1 << 30, limit=2 << 30)
    assert w and f"--ram {((1 << 30) - memory.RUNTIME_OVERHEAD) >> 20}M" in w
    none = memory.check_budget(64 << 20, 3 << 30, limit=2 << 30)     # no room left at all
    assert none and "leave no room for a RAM tier" in none and "--ram" not in none
    assert "trunk is evicted and re-read" in none                    # the 3 GiB trunk makes room
    # ... and where even the trunk out leaves no room, the runtime's own pages go too (a thrash)
    squeezed = memory.check_budget(64 << 20, 16 << 20, limit=memory.RUNTIME_OVERHEAD + (24 << 20),
                                   need=64 << 20)
    assert squeezed and "runtime's own library pages are evicted" in squeezed
    # room for a tier, but not for one layer's experts: no --ram fits either
    short = memory.check_budget(900 << 20, 1 << 30, limit=2 << 30, need=900 << 20)
    assert short and "less than one layer's experts (900 MiB)" in short and "--ram" not in short


def test_fallback_tier_holds_one_layers_experts():
    assert memory.fallback_slab(1 << 20, 8) == memory.FALLBACK_SLAB
    assert memory.fallback_slab(9 << 20, 8) == 72 << 20               # 64 MiB would hold 7
    # run's default: the slab where it holds the experts the run needs, else the fallback
    b = memory.host_budget(1 << 30, limit=2 << 30)
    assert b.default_tier(9 << 20, 8, 8) == b.slab
    assert b.default_tier(b.slab // 7, 8, 8) == memory.fallback_slab(b.slab // 7, 8)
    assert b.default_tier(b.slab // 7, 8, 1) == b.slab                  # staged to a VRAM tier


def test_environment_caps_the_limit(monkeypatch):
    monkeypatch.setattr(memory, "physical_memory", lambda: 32 << 30)
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    assert memory.limit_and_source() == (32 << 30, "physical")
    monkeypatch.setattr(memory, "cgroup_limit", lambda: 8 << 30)
    assert memory.limit_and_source() == (8 << 30, "cgroup")
    monkeypatch.setenv(memory.LIMIT_ENV, "2G")
    assert memory.limit_and_source() == (2 << 30, "env")
    b = memory.host_budget(1 << 30)
    assert b.limit == 2 << 30 and b.source == "env" and b.headroom == 0
    monkeypatch.setenv(memory.LIMIT_ENV, "lots")
    import pytest
    from expertfs.errors import UsageError
    with pytest.raises(UsageError, match=memory.LIMIT_ENV):
        memory.limit_and_source()


def test_fixed_state_does_not_grow():
    assert memory.kv_reserve(1000, state_bytes=400) == 630 + 400
    assert memory.kv_reserve(1000) == 1050


def test_the_kv_cache_at_the_context_limit_is_left_room(monkeypatch):
    """A long context's KV cache lives in host memory on CPU: the default tier leaves it room
    (at its peak: the cache at the limit and a decode step's margin), and the warning counts
    it."""
    monkeypatch.setattr(memory, "physical_memory", lambda: 32 << 30)
    kv = 400 << 20
    plain = memory.default_ram_tier(1 << 30, limit=3 << 30)
    with_kv = memory.default_ram_tier(1 << 30, limit=3 << 30, kv_bytes=kv)
    assert plain - with_kv == memory.kv_reserve(kv) == int(1.05 * kv)
    assert memory.check_budget(with_kv, 1 << 30, limit=3 << 30, kv_bytes=kv) is None
    w = memory.check_budget(plain, 1 << 30, limit=3 << 30, kv_bytes=kv)
    assert w and "KV cache 420 MiB" in w and "--ctx" in w


def test_limit_is_never_above_physical():
    assert 0 < memory.memory_limit() <= memory.physical_memory()


def test_slots_never_exceed_the_experts_there_are(monkeypatch):
    """The policy's tier never has more slots than experts; the slab keeps spare slots beside a
    tier of every expert for the prompt window only (opt-in; at least 2 k, at most a layer's)."""
    geo = SlotGeometry(layers=(0, 1), experts=(4, 4), n_experts=4, k=2, slot_bytes=4096, stride=4096)
    s = plan_slots(geo, 1 << 30, 0, queue_depth=8)
    assert s.host == s.ram == 8
    monkeypatch.setenv("EXPERTFS_PROMPT_WINDOW", "1")
    s = plan_slots(geo, 1 << 30, 0, queue_depth=8)
    assert s.ram == 8 and s.host == 8 + 4
    assert plan_slots(geo, 9 * 4096, 0, queue_depth=8).host == 9      # what the budget leaves
    s = plan_slots(geo, 1 << 30, 1 << 30, queue_depth=8)
    assert s.vram == 8 and s.ram == 0


def test_resident_trunk_leaves_out_an_untied_embedding():
    """The embedding is read a row per token from the mapped trunk: not resident, unless it is
    also the output head (tied), which every token reads whole."""
    from types import SimpleNamespace

    def store(names):
        recs = {n: SimpleNamespace(nbytes=b) for n, b in names.items()}
        return SimpleNamespace(trunk_tensors=lambda: recs,
                               summary={"trunk_file_bytes": sum(names.values()) + 4096})

    untied = store({"token_embd.weight": 600, "output.weight": 600, "blk.0.attn_q.weight": 100})
    tied = store({"token_embd.weight": 600, "blk.0.attn_q.weight": 100})
    assert memory.resident_trunk_bytes(untied) == 1300 + 4096 - 600
    assert memory.resident_trunk_bytes(tied) == 700 + 4096
