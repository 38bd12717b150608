"""Expert reads by (layer, expert): hand-made extents and a real repacked store, checksums on
first read, joining and promoting queued prefetches, and the asyncio front (uvloop too)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from expertfs.errors import IntegrityError, StoreError
from expertfs.formats.ggml import GGMLType
from expertfs.formats.moe_names import Role
from expertfs.store.layout import Extent, Part
from expertfs.runtime.io import (AsyncExpertReader, ExpertIntegrityError, ExpertReader,
                                 IOUsageError, Priority, aligned_empty, get_backend, run,
                                 uvloop_available)
from support.faults import Fault, FaultInjectingBackend

PART_SIZES = (5000, 5000, 4100)       # gate, up, down: unpadded, each padded to 4 KiB


def write_expert_file(path: Path, layers: int = 2, experts: int = 4, *,
                      part_sizes: tuple[int, ...] = PART_SIZES, align: int = 4096,
                      seed: int = 0) -> list[Extent]:
    """An experts.bin laid out like a store's (test helper, also used by other io tests)."""
    rng = np.random.default_rng(seed)
    roles = (Role.GATE, Role.UP, Role.DOWN)
    extents, off = [], 0
    with open(path, "wb") as f:
        for layer in range(layers):
            for e in range(experts):
                parts, rel = [], 0
                for role, n in zip(roles, part_sizes):
                    b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
                    f.write(b + bytes(-n % align))
                    parts.append(Part(role, GGMLType.Q8_0, int(role), (n,), rel, n,
                                      xxhash.xxh3_64_intdigest(b)))
                    rel += n + (-n % align)
                extents.append(Extent(layer, e, off, rel, tuple(parts)))
                off += rel
    return extents


@pytest.fixture
def experts(tmp_path):
    path = tmp_path / "experts.bin"
    return str(path), write_expert_file(path)


def _expected(path: str, e: Extent) -> bytes:
    with open(path, "rb") as f:
        f.seek(e.offset)
        return f.read(e.length)


@pytest.mark.parametrize("backend", ["buffered", "direct", "mmap"])
def test_read_every_expert_verified(experts, backend):
    path, extents = experts
    with ExpertReader(path=path, extents=extents, backend=backend, queue_depth=4) as r:
        futs = [r.read_expert(e.layer, e.expert) for e in extents]
        for e, f in zip(extents, futs):
            got = f.result(10)
            assert got.verified and got.extent == e
            assert bytes(got.buffer.numpy()) == _expected(path, e)
            down = e.part(Role.DOWN)
            assert bytes(got.part(Role.DOWN)) == _expected(path, e)[down.rel_offset:][:4100]
        again = r.read_expert_sync(0, 0)
        assert not again.verified                   # "first": checked once per expert
        assert r.read_expert_sync(0, 0, verify="always").verified
        assert r.stats["verified"] == len(extents) + 1


def test_read_into_slot_and_bad_slots(experts):
    path, extents = experts
    with ExpertReader(path=path, extents=extents, backend="direct") as r:
        slot = aligned_empty(extents[0].length + 4096)
        got = r.read_expert(1, 2, into=slot).result(10)
        assert got.buffer is slot
        assert bytes(slot[:extents[6].length].numpy()) == _expected(path, extents[6])
        with pytest.raises(IOUsageError, match="cannot hold expert"):
            r.read_expert(0, 0, into=aligned_empty(4096))
        with pytest.raises(IOUsageError, match="no extent for layer 9"):
            r.read_expert(9, 0)
        with pytest.raises(IOUsageError, match="verify="):
            r.read_expert(0, 0, verify="sometimes")


def test_corrupt_bytes_raise_integrity_error_naming_the_expert(experts):
    path, extents = experts
    e = extents[5]
    target = e.offset + e.parts[1].rel_offset + 10
    be = FaultInjectingBackend(get_backend("buffered"), [Fault("corrupt", offset=target, times=-1)])
    with ExpertReader(path=path, extents=extents, backend=be) as r:
        with pytest.raises(ExpertIntegrityError) as err:
            r.read_expert_sync(e.layer, e.expert)
        assert isinstance(err.value, IntegrityError)
        assert (err.value.layer, err.value.expert, err.value.role) == (1, 1, "UP")
        assert err.value.path == path and "layer 1, expert 1" in str(err.value)
        assert r.stats["integrity_errors"] == 1
        r.read_expert_sync(0, 0)                       # others are fine
        got = r.read_expert_sync(e.layer, e.expert, verify="never")   # opt-out returns the bytes
        assert not got.verified


def test_extent_past_the_file_is_a_store_error(experts):
    path, extents = experts
    bad = Extent(0, 9, os.path.getsize(path), 4096, ())
    with ExpertReader(path=path, extents=[*extents, bad], backend="buffered") as r:
        with pytest.raises(StoreError, match="past the end of the file"):
            r.read_expert(0, 9)


def test_demand_read_joins_and_promotes_a_queued_prefetch(experts):
    path, extents = experts
    be = FaultInjectingBackend(get_backend("buffered"), [Fault("delay", times=1, delay_s=0.2)])
    with ExpertReader(path=path, extents=extents, backend=be, queue_depth=1) as r:
        first = r.read_expert(0, 0)                   # occupies the single worker (delayed)
        pf = [r.prefetch(1, e) for e in range(4)]
        d = r.read_expert(1, 3)                       # joins pf[3] and moves it ahead
        assert d is pf[3] and d.priority == Priority.DEMAND and r.stats["joined"] == 1
        assert r.cancel_prefetches(keep={(1, 0)}) == 2       # pf[1], pf[2]; pf[3] is demand now
        d.result(10), first.result(10), pf[0].result(10)
        assert pf[0].t_start >= d.t_done
        assert pf[1].cancelled() and pf[2].cancelled()


def test_store_reader_on_a_repacked_store(tmp_path):
    from support.gguf_builders import moe_gguf
    from expertfs.store.repack import repack
    from expertfs.store.reader import Store
    src = moe_gguf(tmp_path / "m.gguf", layers=2, experts=4)[0]
    repack(str(src), str(tmp_path / "m.efs"))
    with Store.open(tmp_path / "m.efs") as store, ExpertReader(store, backend="direct") as r:
        for layer in store.layers:
            for e in range(store.n_experts(layer)):
                got = r.read_expert_sync(layer, e)
                assert got.verified and got.extent == store.extent(layer, e)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_async_front_many_in_flight_and_stale_prefetches(experts, loop):
    if loop == "uvloop" and not uvloop_available():
        pytest.skip("uvloop is not installed (optional: pip install uvloop)")
    path, extents = experts
    be = FaultInjectingBackend(get_backend("buffered"), [Fault("delay", times=1, delay_s=0.2)])

    async def main(r: ExpertReader):
        ar = AsyncExpertReader(r)
        blocker = asyncio.ensure_future(ar.read_expert(0, 0))
        await asyncio.sleep(0.02)
        stale = [ar.prefetch(1, e) for e in range(3)]
        assert ar.prefetch(1, 0) is stale[0]
        demand = asyncio.gather(*(ar.read_expert(0, e) for e in range(1, 4)))
        n = ar.cancel_stale(keep={(1, 2)})            # the forward pass moved on
        got = await demand
        assert [g.extent.expert for g in got] == [1, 2, 3]
        res = await asyncio.gather(*stale, return_exceptions=True)
        await blocker
        waiter = asyncio.ensure_future(ar.read_expert(1, 3, priority=Priority.PREFETCH))
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return n, res

    with ExpertReader(path=path, extents=extents, backend=be, queue_depth=1) as r:
        n, res = run(main(r), use_uvloop=(loop == "uvloop"))
    assert n == 2
    assert isinstance(res[0], asyncio.CancelledError) and isinstance(res[1], asyncio.CancelledError)
    assert res[2].extent.expert == 2
