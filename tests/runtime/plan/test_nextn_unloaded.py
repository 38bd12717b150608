"""A NextN/MTP block is loaded only to draft: without drafts (``run`` without ``--mtp``,
``serve``, ``plan``) its trunk tensors are neither counted resident by the memory model, so the
RAM tier gets their room, nor read ahead or faulted in by the engine."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.plan.host import trunk_host_bytes
from expertfs.runtime.plan.model import geometry_from_store
from support.cache_store import make_store


@pytest.fixture(scope="module")
def nextn_store(tmp_path_factory):
    return str(make_store(tmp_path_factory.mktemp("nextn"), n_nextn=1))


def test_the_memory_model_counts_a_nextn_trunk_only_where_it_drafts(nextn_store):
    g = geometry_from_store(nextn_store)
    assert not g.nextn_loaded and g.nextn_trunk_bytes > 0 and g.nextn_matrices
    loaded = dataclasses.replace(g, nextn_loaded=True)
    assert trunk_host_bytes(loaded, "quant") - trunk_host_bytes(g, "quant") == g.nextn_trunk_bytes
    assert loaded.trunk_resident("quant", 2) - g.trunk_resident("quant", 2) == g.nextn_trunk_bytes
    extra = sum(m.count * (m.elements * 2 - m.nbytes) for m in g.nextn_matrices)
    assert loaded.trunk_resident("float", 2) - g.trunk_resident("float", 2) == \
        g.nextn_trunk_bytes + extra


def test_runs_tier_gets_the_room_without_mtp(nextn_store, monkeypatch):
    from expertfs.cli._tiers import ram_and_lookahead
    from expertfs.runtime.plan.host import run_host_budget
    g = geometry_from_store(nextn_store)
    b = run_host_budget(dataclasses.replace(g, nextn_loaded=True), 64, "cpu", "quant",
                        limit=1 << 40, source="cap")
    limit = b.runtime + b.trunk + b.kv + b.workspace + b.experts // 2    # the cap binds
    monkeypatch.setenv("EXPERTFS_MEMORY_LIMIT", str(limit))

    def tier(mtp: str) -> int:
        ns = argparse.Namespace(store=nextn_store, ctx=64, dtype="auto", trunk="quant", ram=None,
                                vram=0, command="run", mtp=mtp, lookahead="off")
        return ram_and_lookahead(ns, "cpu")[0]
    plain, drafting = tier("0"), tier("auto")
    assert 0 < plain - drafting <= g.nextn_trunk_bytes + g.slot_bytes
    assert (plain - drafting) // g.slot_bytes >= g.nextn_trunk_bytes // g.slot_bytes


def test_an_engine_without_drafts_leaves_the_nextn_tensors_unread(nextn_store, monkeypatch):
    from expertfs.runtime.model.weights import TrunkReader
    advised: list[list[tuple[int, int]]] = []
    real = TrunkReader._advise

    def spy(self, advice, skip=()):
        advised.append(list(skip))
        return real(self, advice, skip)
    monkeypatch.setattr(TrunkReader, "_advise", spy)
    with Engine.open(nextn_store, ram_bytes=32 << 20,
                     options=EngineOptions(load_nextn=False)) as eng:
        unused = eng.reader.unused_pages
        assert unused and not eng.trunk.nextn
        eng.warm()                                   # populate: the whole trunk but those
        eng.prefill([1, 2, 3])
    assert all(set(unused) <= set(skip) for skip in advised) and len(advised) >= 1
    with Engine.open(nextn_store, ram_bytes=32 << 20) as eng:    # the default: loaded
        assert eng.reader.unused_pages == [] and eng.trunk.nextn


@pytest.mark.parametrize("mtp,loaded", [("0", False), ("2", True), ("auto", True)])
def test_run_loads_the_block_only_to_draft(nextn_store, monkeypatch, capsys, mtp, loaded):
    from expertfs.cli import main
    from expertfs.runtime import mtp as mtp_pkg
    seen, attach = [], mtp_pkg.attach

    def spy(eng, options):
        seen.append(eng.options.load_nextn)
        return attach(eng, options)
    monkeypatch.setattr(mtp_pkg, "attach", spy)      # run's _open imports it at the call
    assert main(["run", nextn_store, "-p", "hi", "-n", "2", "--mtp", mtp, "--json"]) == 0
    assert seen == [loaded]


def test_plans_tier_is_runs_default_for_a_store_with_a_nextn_block(nextn_store, monkeypatch,
                                                                    capsys):
    """``plan`` budgets the run it recommends (no drafts): its "run it:" tier is ``run``'s
    default under the same cap, the NextN trunk left out of both."""
    import json

    from expertfs.cli import main
    from expertfs.cli._tiers import ram_and_lookahead
    g = geometry_from_store(nextn_store)
    fast = ["--no-probe", "--tokens", "24", "--vram", "0", "--ctx", "64", "--placement", "cpu",
            "--trunk", "quant", "--json"]
    assert main(["plan", nextn_store, "--memory-limit", "64G", *fast]) == 0
    b = json.loads(capsys.readouterr().out)["budget"]
    limit = str(b["ram"]["fixed_bytes"] + b["decode_experts"] * b["slot_bytes"] // 2)
    assert main(["plan", nextn_store, "--memory-limit", limit, *fast]) == 0
    b = json.loads(capsys.readouterr().out)["budget"]
    assert next(i for i in b["ram"]["items"] if i["name"] == "trunk")["bytes"] == \
        trunk_host_bytes(g, "quant")
    monkeypatch.setenv("EXPERTFS_MEMORY_LIMIT", limit)
    ns = argparse.Namespace(store=nextn_store, ctx=64, dtype="auto", trunk="quant", ram=None,
                            vram=0, command="run", mtp="0", lookahead="off")
    assert ram_and_lookahead(ns, "cpu")[0] // g.slot_bytes == b["host_slab_bytes"] // g.slot_bytes
