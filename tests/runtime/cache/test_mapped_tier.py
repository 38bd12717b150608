"""The mapped RAM tier (``slots.MappedPool`` over ``io.FileMapping``) on a real tiny store: chosen
only where the tier holds every expert on the CPU, alone, and asked for (or ``auto`` with an
auto-picked backend); every expert's bytes are the store's, read once by faulting the file's
range in and checksummed on that read; corrupt bytes raise the integrity error naming the
expert; the file is never written; a model's logits equal the slab's bit for bit."""

from __future__ import annotations

import gc
import hashlib
import os
import shutil

import pytest
import torch

from expertfs.errors import UsageError
from expertfs.runtime.cache.slots import MAPPED_WHEN_CACHED
from expertfs.runtime.io import ExpertIntegrityError, IOUsageError
from expertfs.runtime.io.mapped import FileMapping, populate_supported
from expertfs.runtime.io.pagecache import drop_file_cache
from expertfs.store.reader import Store

from support.cache_store import (assert_weights, check_invariants, every_slot as every,
                                 make_store, store_bytes, tiered as provider)

pytestmark = pytest.mark.skipif(not populate_supported(),
                                reason="needs madvise(MADV_POPULATE_READ): Linux 5.14 or later")


def evict(path) -> None:
    """The file's pages out of the page cache (a cold start); mapped pages stay, so the
    mappings of earlier tests are collected first."""
    gc.collect()
    drop_file_cache(path)


def digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_file_mapping_views_populate_and_bounds(store):
    data = store_bytes(store)
    m = FileMapping(store.experts_path)
    e = store.extent(store.layers[0], 3)
    assert m.populate(e.offset, e.length) == e.length
    v = m.view(e.offset, e.length)
    assert bytes(v.numpy()) == data[e.offset:e.offset + e.length]
    assert m.at(v) == e.offset and m.at(v[4096:]) == e.offset + 4096
    assert m.at(torch.zeros(8, dtype=torch.uint8)) is None
    with pytest.raises(IOUsageError, match="outside the mapped file"):
        m.view(m.size - 8, 16)
    m.close()
    with pytest.raises(IOUsageError, match="closed mapping"):
        m.view(0, 8)


def test_a_tier_of_every_expert_is_the_mapped_file_and_serves_its_bytes(store):
    data = store_bytes(store)
    before = digest(store.experts_path)
    with provider(store, every(store), ram_tier="mapped") as p:
        assert p.describe()["ram_tier"] == "mapped"
        assert p.describe()["pin_note"].startswith("mapped")
        for layer in store.layers:
            ids = list(range(0, store.n_experts(layer), 3))
            assert_weights(store, data, layer, p.get(layer, ids))
            p.release(layer)
            assert_weights(store, data, layer, p.get(layer, ids[::-1]))     # hits
            p.release(layer)
        n = sum(len(range(0, store.n_experts(la), 3)) for la in store.layers)
        assert p.stats.misses == n and p.stats.hits["ram"] == n
        assert p.reader.stats["verified"] == n                   # checksummed when read
        check_invariants(p)
    assert digest(store.experts_path) == before                  # nothing written to the file


def test_the_warm_start_fills_the_mapped_tier(store):
    data = store_bytes(store)
    with provider(store, every(store), ram_tier="mapped", warm_start=True) as p:
        layer = store.layers[-1]
        ids = list(range(store.n_experts(layer)))
        assert_weights(store, data, layer, p.get(layer, ids))
        p.release(layer)
        check_invariants(p)


def test_the_slab_where_the_mapped_tier_does_not_apply(store):
    small = every(store) // 3
    with provider(store, small, ram_tier="mapped") as p:       # not every expert: a cache
        assert p.describe()["ram_tier"] == "slab"
    with provider(store, every(store)) as p:                    # auto, a backend by name
        assert p.describe()["ram_tier"] == "slab"
    with provider(store, every(store), ram_tier="slab") as p:
        assert p.describe()["ram_tier"] == "slab"
    with pytest.raises(UsageError, match="ram_tier="):
        provider(store, every(store), ram_tier="page-cache")


def test_auto_maps_a_file_the_page_cache_holds_with_an_auto_backend(store, monkeypatch,
                                                                    tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    provider(store, every(store), backend="auto").close()       # auto's probe, then cached
    evict(store.experts_path)                # a cold start (where the file system lets go)
    probe = FileMapping(store.experts_path)
    cold = "mapped" if probe.cached_fraction() >= MAPPED_WHEN_CACHED else "slab"
    probe.close()
    with provider(store, every(store), backend="auto") as p:
        assert p.describe()["ram_tier"] == cold
    store_bytes(store)                                           # a rerun: the file cached
    with provider(store, every(store), backend="auto") as p:
        assert p.describe()["ram_tier"] == "mapped"
    monkeypatch.setenv("EXPERTFS_MAPPED_TIER", "0")
    with provider(store, every(store), backend="auto") as p:
        assert p.describe()["ram_tier"] == "slab"


def test_cached_fraction_follows_the_page_cache(store):
    m = FileMapping(store.experts_path)
    evict(store.experts_path)
    assert 0.0 <= m.cached_fraction() <= 1.0    # (tmpfs keeps its pages: no claim on cold)
    m.populate(0, m.size)
    assert m.cached_fraction() == 1.0
    m.close()
    assert m.cached_fraction() == 0.0


def test_corrupt_bytes_in_the_file_raise_the_integrity_error(store_path, tmp_path):
    bad = tmp_path / "bad.efs"
    shutil.copytree(store_path, bad)
    s = Store.open(str(bad))
    try:
        layer = s.layers[1]
        e = s.extent(layer, 5)
        with open(s.experts_path, "r+b") as f:
            f.seek(e.offset + e.parts[0].rel_offset + 7)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        with provider(s, every(s), ram_tier="mapped") as p:
            with pytest.raises(ExpertIntegrityError) as err:
                p.get(layer, [5])
            assert (err.value.layer, err.value.expert) == (layer, 5)
            p.release(layer)
            assert p.get(layer, [4])                             # the others still serve
            p.release(layer)
    finally:
        s.close()


def test_logits_equal_the_slab_bit_for_bit(store_path):
    from expertfs.runtime.engine import Engine
    out = {}
    for tier in ("mapped", "slab"):
        with Engine.open(str(store_path), provider="tiered", ram_bytes=64 << 20,
                         provider_options={"ram_tier": tier, "warm_start": False}) as eng:
            assert eng.provider.describe()["ram_tier"] == tier
            logits = eng.prefill([1, 5, 9, 3, 7])
            steps = [eng.decode(t) for t in (11, 2, 8)]
            out[tier] = [logits, *steps]
    for a, b in zip(out["mapped"], out["slab"]):
        assert torch.equal(a, b)


def test_a_tier_of_every_routed_expert_maps_with_a_nextn_block(tmp_path):
    """``run`` leaves a NextN block's experts (drafts only) out of the tier it sizes: a tier of
    every other expert still maps, and a draft's expert is still served from the file."""
    s = Store.open(str(make_store(tmp_path, n_nextn=1)))
    try:
        data = store_bytes(s)
        draft = [la for la in s.layers if s.layer_info(la).get("nextn")]
        assert draft
        slot = max(s.extent(la, 0).length for la in s.layers)
        routed = sum(s.n_experts(la) for la in s.layers if la not in draft)
        with provider(s, routed * slot, ram_tier="mapped") as p:
            assert p.cache.geo.routed == routed and p.describe()["ram_tier"] == "mapped"
            assert_weights(s, data, draft[0], p.get(draft[0], [0, 3]))
            p.release(draft[0])
        with provider(s, (routed - 1) * slot, ram_tier="mapped") as p:
            assert p.describe()["ram_tier"] == "slab"
    finally:
        s.close()
