"""The CUDA ordering of the mechanism, checked without a GPU. A fake GPU has a copy stream and a
compute stream, each an in-order queue that runs a random amount whenever the mechanism calls
the copier (sometimes quick, sometimes far behind the host). A copy runs after the compute marks
it was ordered after, a "kernel" (the test reading a layer's weights) after the copies the
compute stream was told to wait for, an event is done only once its copy ran, and the host
blocks only where the mechanism synchronises. Had the mechanism left out a wait (compute on a
slot still uploading, a storage read into a host slot an upload still reads, an upload into a
slot a queued kernel still reads), a kernel would see other bytes than the store's. Removing
any of those waits from the mechanism makes this test fail."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from expertfs.runtime.cache import tiers
from expertfs.runtime.cache.provider import TieredProvider
from expertfs.store.reader import Store

from support.cache_store import K, N_EXPERTS, assert_weights, check_invariants, make_store, store_bytes


class FakeEvent:
    """A copy-stream event: done once the copy stream ran ``seq`` ops."""

    def __init__(self, gpu: "FakeGPU", seq: int) -> None:
        self.gpu, self.seq = gpu, seq

    def query(self) -> bool:
        return self.gpu.copy_done >= self.seq

    def synchronize(self) -> None:
        self.gpu.run_copy(self.seq)


class ComputeMark:
    """A compute-stream mark: done once ``n`` kernels ran."""

    def __init__(self, n: int) -> None:
        self.n = n


class FakeGPU:
    """Two in-order queues, each entry waiting on the other's progress (never forward)."""

    def __init__(self) -> None:
        self.copies: list = []          # (fn, kernels it waits for)
        self.kernels: list = []         # (fn, copies it waits for)
        self.copy_done = 0
        self.compute_done = 0

    def run_copy(self, seq: int) -> None:
        while self.copy_done < seq:
            fn, need = self.copies[self.copy_done]
            self.run_compute(need)
            fn()
            self.copies[self.copy_done] = None
            self.copy_done += 1

    def run_compute(self, n: int) -> None:
        while self.compute_done < n:
            fn, need = self.kernels[self.compute_done]
            self.run_copy(need)
            fn()
            self.kernels[self.compute_done] = None
            self.compute_done += 1


class FakeAsyncCopier:
    """The ``Copier`` interface with a GPU's asynchrony, on CPU memory: copies and the test's
    "kernels" run later, in stream order, a random amount at every call into the copier."""

    cuda = True

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.gpu = FakeGPU()
        self.rng = random.Random(seed)
        self.need = 0                       # copies the next kernel waits for

    def progress(self) -> None:
        g, r = self.gpu, self.rng
        if r.random() < 0.5:                # often far behind the host
            return
        g.run_copy(g.copy_done + r.randint(0, len(g.copies) - g.copy_done))
        g.run_compute(g.compute_done + r.randint(0, len(g.kernels) - g.compute_done))

    def _enqueue(self, op, after, then) -> FakeEvent:
        self.progress()
        need = max((f.n for f in after if isinstance(f, ComputeMark)), default=0)
        self.gpu.copies.append((op, need))
        if then is not None:
            then()                          # host code that queues device writes
        return FakeEvent(self.gpu, len(self.gpu.copies))

    def copy_slots(self, dst, d, src, s, n, *, after=(), then=None):
        da, sa = dst.address(d), src.address(s)
        return self._enqueue(lambda: ctypes.memmove(da, sa, n), after, then)

    def copy(self, dst, src, *, after=(), then=None):
        return self._enqueue(lambda: dst.copy_(src), after, then)

    def transient(self, src, *, after=()):
        dst = torch.empty_like(src)
        return dst, self._enqueue(lambda: dst.copy_(src), after, None)

    def on_stream(self, fn) -> None:
        fn()

    def compute_wait(self, fence) -> None:
        if fence is not None:
            self.need = max(self.need, fence.seq)

    def compute_mark(self) -> ComputeMark:
        return ComputeMark(len(self.gpu.kernels))

    def kernel(self, fn) -> None:
        """The test's compute: runs after every copy the compute stream was told to wait for."""
        self.gpu.kernels.append((fn, self.need))

    def synchronize(self) -> None:
        self.gpu.run_copy(len(self.gpu.copies))
        self.gpu.run_compute(len(self.gpu.kernels))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store.open(str(make_store(tmp_path_factory.mktemp("cache_async"))))
    yield s
    s.close()


def make(store, monkeypatch, seed, ram, vram, **kw):
    fakes = []

    def factory(device):
        fakes.append(FakeAsyncCopier(device, seed))
        return fakes[-1]
    monkeypatch.setattr(tiers, "Copier", factory)
    slot = max(store.extent(la, 0).length for la in store.layers)
    p = TieredProvider(store, ram_bytes=ram * slot, vram_bytes=vram * slot, backend="buffered",
                       warm_start=False, record_usage=False, **kw)
    return p, fakes[0]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ram,vram,staging", [(12, 6, 3), (7, 6, 3), (14, 10, 5), (5, 8, 5),
                                              (8, 0, None)])
def test_deferred_copies_never_show_wrong_bytes(store, monkeypatch, seed, ram, vram, staging):
    _run_deferred(store, monkeypatch, seed, ram, vram, staging, split=False)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ram,vram,staging", [(12, 6, 3), (7, 6, 3), (5, 8, 5)])
def test_split_gets_compute_each_expert_as_it_arrives(store, monkeypatch, seed, ram, vram, staging):
    """``get_begin``/``finish(some=True)`` on the device tier (issue 17 item 6): a kernel is
    queued for the experts ready at once, then for each group as its reads land and its
    uploads are queued; every kernel still sees the store's bytes."""
    _run_deferred(store, monkeypatch, seed, ram, vram, staging, split=True)


def _run_deferred(store, monkeypatch, seed, ram, vram, staging, split):
    data = store_bytes(store)
    p, fake = make(store, monkeypatch, seed, ram, vram, staging_slots=staging,
                   history=seed % 2 == 1)
    rng = random.Random(100 + seed)
    checked = []

    def check(layer, got):
        def kernel():
            assert_weights(store, data, layer, got)
            checked.append(layer)
        return kernel
    try:
        held = None
        for step in range(120):
            layer = rng.choice(store.layers)
            if held is not None and (layer == held[0] or rng.random() < 0.6):
                fake.kernel(check(*held))            # the held layer reads its slots again
                p.release(held[0])
                held = None
            if held is not None and layer == held[0]:
                continue
            ids = rng.sample(range(N_EXPERTS), rng.randint(1, 2 if held is not None else K))
            if rng.random() < 0.3:
                nxt = store.layers[(store.layers.index(layer) + 1) % len(store.layers)]
                p.prefetch(nxt, rng.sample(range(N_EXPERTS), 3))
            if split:
                ready, finish = p.get_begin(layer, ids)
                got, rest = dict(ready), [e for e in ids if e not in ready]
                if ready:
                    fake.kernel(check(layer, ready))
                while rest:
                    part = finish(rest, some=True)
                    assert part
                    fake.kernel(check(layer, part))
                    got.update(part)
                    rest = [e for e in rest if e not in part]
            else:
                got = p.get(layer, ids)
            fake.kernel(check(layer, got))
            if held is None and rng.random() < 0.5:
                held = (layer, got)
            else:
                p.release(layer)
            if step % 10 == 0 and held is None:
                check_invariants(p)
        if held is not None:
            p.release(held[0])
        fake.synchronize()
        assert len(checked) == len(fake.gpu.kernels)
        check_invariants(p)
        st = p.stats
        if vram:
            assert st.uploads > 0 and st.hits.get("vram", 0) > 0
            if ram > staging:
                assert st.demotions > 0 and st.evictions["ram"] > 0
        else:
            assert st.uploads == st.requests                 # a device copy per get
    finally:
        p.close()


class OrderedTableCopier(FakeAsyncCopier):
    """As above, and the slot table's device writes are copy-stream ops too: a write queued
    from a copy's ``then`` runs after that copy's waits, one queued outside any copy (the old
    clear, through ``on_stream``) waits for nothing."""

    def __init__(self, device, seed=0):
        super().__init__(device, seed)
        self._need = None

    def _enqueue(self, op, after, then):
        need = max((f.n for f in after if isinstance(f, ComputeMark)), default=0)
        self._need = need
        try:
            return super()._enqueue(op, after, then)
        finally:
            self._need = None

    def on_stream(self, fn) -> None:
        self.gpu.copies.append((fn, 0))

    def defer(self, fn) -> None:
        self.gpu.copies.append((fn, self._need or 0))


@pytest.mark.parametrize("seed", range(3))
def test_device_slot_table_writes_follow_the_slot_fence(store, monkeypatch, seed):
    """A mirrored (device-like) slot table under the fake GPU: every kernel sees, in the table's
    device copy, the slot of each expert it reads, so no clear of a victim reaches the device
    before the kernels that read the victim ran; and each table write is one batch."""
    fakes = []

    def factory(device):
        fakes.append(OrderedTableCopier(device, seed))
        return fakes[-1]
    real_table = tiers.SlotTable

    def table_factory(n_layers, n_experts, device, copier):
        t = real_table(n_layers, n_experts, device, copier, mirror=True)
        write = t._write
        t._write = lambda batch: copier.defer(lambda: write(batch.clone()))
        return t
    monkeypatch.setattr(tiers, "Copier", factory)
    monkeypatch.setattr(tiers, "SlotTable", table_factory)
    slot = max(store.extent(la, 0).length for la in store.layers)
    p = TieredProvider(store, ram_bytes=7 * slot, vram_bytes=6 * slot, backend="buffered",
                       warm_start=False, record_usage=False, staging_slots=3)
    fake, table = fakes[0], p.cache.table
    assert not table._shared
    rng = random.Random(seed)
    seen = []

    def kernel(want):
        def run():
            got = [int(table.device[li, ex]) for li, ex, _ in want]
            assert got == [d for _, _, d in want]
            seen.append(len(want))
        return run
    try:
        for _ in range(80):
            layer = rng.choice(store.layers)
            p.get(layer, rng.sample(range(N_EXPERTS), K))
            want = [(*divmod(e.key, N_EXPERTS), e.dev_slot) for e in p.cache.held[layer]]
            fake.kernel(kernel(want))
            p.release(layer)
        fake.synchronize()
        assert len(seen) == 80
        assert p.stats.uploads > 0 and p.stats.evictions["vram"] > 0
        assert table.writes <= p.stats.uploads and table.pending <= 1
        assert (table.device.numpy()[table.host >= 0] == table.host[table.host >= 0]).all()
    finally:
        p.close()
