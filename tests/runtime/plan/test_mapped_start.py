"""``plan`` and the mapped RAM tier: where ``run`` would map its tier (``cache.slots.maps_tier``)
the start reads from the drive only what the page cache lacks (``coldstart.drive_share``), in
the first token (``prefill.first_token``) and the decode's start terms (``predict``)."""

from __future__ import annotations

import os

import pytest

from expertfs.cli.plan import geometry_from_like
from expertfs.runtime.cache.slots import MAPPED_WHEN_CACHED, maps_tier
from expertfs.runtime.io.mapped import populate_supported
from expertfs.runtime.plan.assumptions import GiB
from expertfs.runtime.plan.budget import Box, layout
from expertfs.runtime.plan.coldstart import (STATED_VERIFY_S_PER_GB, drive_share, start_terms,
                                             store_page_cache, verify_cost)
from expertfs.runtime.plan.predict import predict
from expertfs.runtime.plan.prefill import first_token
from expertfs.runtime.plan.rates import Range

from test_coldstart import _routing  # noqa: I001 - the sibling test modules' helpers
from test_plan import rates_for
from test_prefill import GEMM

mapping = pytest.mark.skipif(not populate_supported(),
                             reason="this kernel cannot fault a file range in")


@pytest.fixture(scope="module")
def g():
    return geometry_from_like("Qwen3-30B-A3B")


def uncapped(g, page_cache: float = 0.0, **kw) -> tuple[Box, object]:
    box = Box(64 * GiB, 0, ctx=512, page_cache=page_cache, **kw)
    return box, layout(g, box, "cpu", "quant")


@mapping
def test_the_rule_is_runs(monkeypatch):
    def rule(ram_tier="auto", fits=True, cuda=False, alone=True, auto=True, cached=0.9):
        return maps_tier(ram_tier, fits=fits, cuda=cuda, alone=alone, auto_backend=auto,
                         cached=lambda: cached)
    assert rule() and rule(cached=MAPPED_WHEN_CACHED) and rule("mapped", cached=0.0)
    assert not rule(cached=MAPPED_WHEN_CACHED - 0.01) and not rule("slab")
    assert not rule(fits=False) and not rule(cuda=True) and not rule(alone=False)
    assert not rule(auto=False) and rule("mapped", auto=False)      # a backend by name
    monkeypatch.setenv("EXPERTFS_MAPPED_TIER", "0")
    assert not rule() and rule("mapped")


@mapping
def test_the_drive_serves_what_the_page_cache_lacks_where_run_maps(g, monkeypatch):
    box, mem = uncapped(g)
    assert mem.ram.tier_slots >= g.n_decode_experts
    assert drive_share(g, mem, 0.9) == pytest.approx(0.1)
    assert drive_share(g, mem, 1.0) == 0.0
    assert drive_share(g, mem, 0.3) == 1.0                    # below the rule's share: a slab
    capped = layout(g, Box(g.slot_bytes * g.n_decode_experts // 2, 0, ctx=512,
                           limit_source="limit"), "cpu", "quant")
    assert capped.ram.tier_slots < g.n_decode_experts
    assert drive_share(g, capped, 1.0) == 1.0                 # a cache that evicts: a slab
    monkeypatch.setenv("EXPERTFS_MAPPED_TIER", "0")
    assert drive_share(g, mem, 1.0) == 1.0


@mapping
def test_the_first_token_and_the_start_terms_scale_with_the_drive_share(g):
    rates = rates_for(g)
    _, mem = uncapped(g)
    cold = first_token(g, rates, sum(mem.tier_slots), 64, GEMM)
    cached = first_token(g, rates, sum(mem.tier_slots), 64, GEMM, drive=0.25)
    assert cached.read_bytes[0] == pytest.approx(0.25 * cold.read_bytes[0])
    assert cached.fresh_s[0] == pytest.approx(0.25 * cold.fresh_s[0])
    assert cached.compute_s == cold.compute_s and cached.s_slow < cold.s_slow
    assert first_token(g, rates, sum(mem.tier_slots), 64, GEMM, drive=0.0).read_bytes == (0, 0)
    # the decode's start: the first reads and the warm start's left scale alike (both mapped:
    # a cold slab's prompt reads through its spare slots instead, ``cache.window``)
    a_box, a_mem = uncapped(g, 0.5, n_predict=16, prompt_tokens=8)
    b_box, b_mem = uncapped(g, 0.75, n_predict=16, prompt_tokens=8)
    a, b = (predict(g, m, _routing(0.0), rates, x) for m, x in ((a_mem, a_box), (b_mem, b_box)))
    for name in ("first_reads", "warm_start"):
        assert b.term(name).slow_s == pytest.approx(0.5 * a.term(name).slow_s, rel=1e-6)
    assert a.term("warm_start").slow_s > 0


def test_the_page_cache_share_of_a_store_file(tmp_path):
    d = tmp_path / "m.efs"
    d.mkdir()
    path = d / "experts.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        f.read()
    assert store_page_cache(str(path)) == (1.0 if populate_supported() else 0.0)
    other = tmp_path / "m.gguf"                               # run reads a store, not a GGUF
    other.write_bytes(b"GGUF" + bytes(8188))
    assert store_page_cache(str(other)) == 0.0
    assert store_page_cache(None) == 0.0 and store_page_cache(str(d / "none.bin")) == 0.0


def test_the_checksums_of_each_experts_first_load_cost_cpu(g):
    """Every expert's first load is checksummed (read or mapped): the first token adds that CPU
    for the experts the prompt loads, at most every expert once, and the warm start for what it
    loads, the mapped ones included."""
    rates = rates_for(g)
    check = Range(0.06, 0.04, "t")
    slots = g.n_decode_experts
    plain = first_token(g, rates, slots, 64, GEMM)
    ft = first_token(g, rates, slots, 64, GEMM, verify=check)
    assert plain.verify_s == (0.0, 0.0) and ft.compute_s == plain.compute_s
    assert ft.verify_s[0] == pytest.approx(plain.read_bytes[0] / 1e9 * 0.06)
    assert ft.s_slow == pytest.approx(plain.s_slow + ft.verify_s[0])
    mapped = first_token(g, rates, slots, 64, GEMM, verify=check, drive=0.0)
    assert mapped.read_bytes == (0, 0) and mapped.verify_s == ft.verify_s   # checked all the same
    every = sum(g.extent_bytes) * g.n_experts
    long = first_token(g, rates, slots, 100_000, GEMM, verify=check)
    assert long.verify_s[0] == pytest.approx(every / 1e9 * 0.06)           # once an expert
    args = dict(hits=(1.0, 1.0), tier_bytes=every, ram_tier_bytes=every, prompt_tokens=8,
                n_predict=16, prompt_cover=0.0, storage=Range(1.0, 2.0, "t"),
                read_cpu=Range(0.5, 0.25, "t"), compute_s=(10.0, 5.0))

    def warm(**kw) -> float:
        return next(s for name, s, _, _ in start_terms(g, **args, **kw) if name == "warm_start")
    assert warm(verify=check) > warm()
    assert warm(drive=0.0) == 0.0 and warm(drive=0.0, verify=check) > 0    # mapped: checksums


def test_the_checksum_rate_is_measured_or_stated():
    stated = verify_cost(probe=False)
    assert (stated.slow, stated.fast) == STATED_VERIFY_S_PER_GB and "stated" in stated.source
    got = verify_cost()
    assert got.slow == pytest.approx(1.5 * got.fast) and 0 < got.fast < 10


def test_the_speed_checks_spread_widens_a_rate_and_a_time():
    from expertfs.runtime.plan.boxcache import spread_range
    r = Range(2.0, 4.0, "x")
    assert spread_range(r, 1.0, 1.0) is r
    wide = spread_range(r, 0.5, 1.25)
    assert (wide.slow, wide.fast) == (1.0, 5.0) and "speed checks" in wide.source
    t = spread_range(Range(0.06, 0.04, "x"), 0.5, 1.25, seconds=True)
    assert (t.slow, t.fast) == (pytest.approx(0.12), pytest.approx(0.032))
