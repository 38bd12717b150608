"""Helpers shared by the cache, tiered-provider and prefetch tests: a tiny real store (synthesised
and repacked), its bytes, a read gate to hold reads in flight, and residency invariants."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from expertfs.store.repack import repack
from expertfs.runtime.cache import State
from expertfs.runtime.io import BufferedBackend, IOBackend, RawFile
from expertfs.store.reader import Store
from expertfs.synth import SynthConfig, synthesize

K = 4
N_EXPERTS = 16


def make_store(root: Path, n_nextn: int = 0) -> Path:
    """glm4moe, one leading dense block (routed layers 1..3), 16 experts of mixed quant types,
    so extents differ in size between layers (28 KiB and 20 KiB); ``n_nextn`` NextN blocks
    (routed layers 4..) after them."""
    cfg = dataclasses.replace(SynthConfig.tiny("glm4moe"), n_layers=4, n_dense_lead=1,
                              n_experts=N_EXPERTS, n_expert_used=K, n_embd=256, n_ff_exp=32,
                              n_vocab=300, n_ff=64, quant="mixed", n_nextn=n_nextn)
    files = synthesize(cfg, root / "m.gguf", overwrite=True)
    out = root / "m.efs"
    repack(files, str(out))
    return out


def tiny_store(root: Path, quant: str = "q4_k_m") -> str:
    """``synth``'s tiny qwen3moe in ``quant``, repacked under ``root``: the store's path."""
    g, out = root / "m.gguf", root / "m.efs"
    synthesize(SynthConfig.tiny("qwen3moe").replace(quant=quant), str(g))
    repack([str(g)], str(out))
    return str(out)


def every_slot(store: Store) -> int:
    """RAM for a slot of every expert of ``store`` (and a little over): a tier that holds it."""
    n = sum(store.n_experts(la) for la in store.layers)
    return (n + 2) * max(store.extent(la, 0).length for la in store.layers)


def tiered(store: Store, ram: int, **kw: Any) -> Any:
    """A ``TieredProvider`` of ``ram`` bytes on the buffered backend, no warm start and no
    usage recorded unless ``kw`` says otherwise."""
    from expertfs.runtime.cache.provider import TieredProvider
    kw.setdefault("backend", "buffered")
    kw.setdefault("warm_start", False)
    kw.setdefault("record_usage", False)
    return TieredProvider(store, ram_bytes=ram, **kw)


def store_bytes(store: Store) -> bytes:
    with open(store.experts_path, "rb") as f:
        return f.read()


def assert_weights(store: Store, data: bytes, layer: int, got: dict[int, Any]) -> None:
    """Every part of every returned expert equals the store's bytes."""
    for expert, w in got.items():
        ext = store.extent(layer, expert)
        assert w.layer == layer and w.expert == expert
        assert set(w.parts) == {p.role for p in ext.parts}
        for p in ext.parts:
            q = w.parts[p.role]
            want = data[ext.offset + p.rel_offset:ext.offset + p.rel_offset + p.nbytes]
            assert q.ggml_type == p.ggml_type
            assert q.raw.numel() == p.nbytes
            assert bytes(q.raw.cpu().numpy()) == want, (layer, expert, p.role)


class _GatedFile(RawFile):
    """A file of a gated backend: each read asks the gate (``before_read``) before it runs."""

    def __init__(self, inner: RawFile, gate: "GatedBackend | PerReadGate") -> None:
        super().__init__(inner.path, inner.size)
        self.inner, self.gate = inner, gate

    def prepare(self, buf: Any) -> Any:
        return self.inner.prepare(buf)

    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        self.gate.before_read(file_offset)
        return self.inner.pread_into(dest, start, end, file_offset)

    def close(self) -> None:
        self.inner.close()


class GatedBackend(IOBackend):
    """Buffered reads that wait until ``release`` is set: reads can be held in flight."""

    name = "gated"

    def __init__(self) -> None:
        self.inner = BufferedBackend()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.started: list[int] = []

    def before_read(self, offset: int) -> None:
        with self.lock:
            self.started.append(offset)
        self.release.wait()

    def open_raw(self, path: Any) -> RawFile:
        return _GatedFile(self.inner.open_raw(path), self)


class PerReadGate(IOBackend):
    """Buffered reads; a read starting at a held offset waits until that offset is let go."""

    name = "held"

    def __init__(self) -> None:
        self.inner = BufferedBackend()
        self.held: dict[int, threading.Event] = {}
        self.waiting: set[int] = set()
        self.lock = threading.Lock()

    def hold(self, offset: int) -> None:
        self.held[offset] = threading.Event()

    def let_go(self, offset: int) -> None:
        self.held.pop(offset).set()

    def before_read(self, offset: int) -> None:
        ev = self.held.get(offset)
        if ev is not None:
            with self.lock:
                self.waiting.add(offset)
            ev.wait(30)

    def open_raw(self, path: Any) -> RawFile:
        return _GatedFile(self.inner.open_raw(path), self)


def check_invariants(p: Any) -> None:
    """Residency, slots, policies and the slot table agree; budgets hold. Call between gets."""
    c = p.cache
    host = [e.host_slot for e in c.entries.values() if e.host_slot >= 0]
    dev = [e.dev_slot for e in c.entries.values() if e.dev_slot >= 0]
    assert len(set(host)) == len(host) and len(set(dev)) == len(dev)
    assert len(host) + c.host.n_free == c.host.n_slots
    if c.dev is not None:
        assert len(dev) + c.dev.n_free == c.dev.n_slots
    in_ram = in_vram = 0
    staged = getattr(c, "staged", {})
    assert len(staged) <= c.slots.prefetch
    for key, e in c.entries.items():
        if key in staged:                     # a staged prefetch: outside the tier
            assert staged[key] is e and e.staging and e.source is not None
            assert e.state in (State.LOADING, State.HOST) and e.host_slot >= 0
            assert c.R is None or key not in c.R
            continue
        assert e.key == key and not e.staging
        if e.state in (State.LOADING, State.HOST):
            assert e.host_slot >= 0 and e.dev_slot < 0
            assert c.R is not None and key in c.R
            in_ram += 1
        else:
            assert e.state in (State.UPLOADING, State.DEVICE)
            assert e.dev_slot >= 0 and e.host_slot < 0 and key in c.V
            in_vram += 1
            li, ex = divmod(key, c.geo.n_experts)
            assert c.table.lookup(li, ex) == e.dev_slot
    assert len(c.R or ()) == in_ram and len(c.V or ()) == in_vram
    assert in_ram <= c.slots.ram and in_vram <= c.slots.vram
    assert c.host.nbytes <= p.ram_bytes and (c.dev.nbytes if c.dev else 0) <= p.vram_bytes
    if c.table is not None and c.dev is None:
        resident = {(e.key // c.geo.n_experts, e.expert): e.host_slot
                    for e in c.entries.values() if e.state is State.HOST}
        table = {(int(li), int(ex)): int(c.table.host[li, ex])
                 for li, ex in zip(*(c.table.host >= 0).nonzero())}
        assert table == resident
