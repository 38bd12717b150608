"""``TrunkReader.populate`` / ``prefetch``: trunk.bin's pages in memory before the forward touches
them (as llama.cpp's ``MAP_POPULATE``), checked with mincore(2) on the map itself after the
file's pages were dropped from the page cache."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import pytest

from expertfs.runtime.model.weights import TrunkReader
from expertfs.store.reader import Store
from support.cache_store import tiny_store

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="Linux page cache")


def pages_in(reader: TrunkReader) -> list[bool]:
    """Which of the map's pages are in memory (mincore)."""
    mm = reader._mm
    n = (len(mm) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)), vec) == 0
    return [bool(v & 1) for v in vec]


def resident(reader: TrunkReader, skip: list[tuple[int, int]] = ()) -> float:
    """The share of the map's pages in memory, those of the byte ranges ``skip`` left out."""
    out = {i // mmap.PAGESIZE for a, b in skip for i in range(a, b, mmap.PAGESIZE)}
    got = [v for i, v in enumerate(pages_in(reader)) if i not in out]
    return sum(got) / len(got)


def cold_reader(store: Store) -> TrunkReader:
    """A reader of trunk.bin after its pages were dropped from the page cache."""
    fd = os.open(store.trunk_path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    r = TrunkReader(store)
    if resident(r) > 0.5:
        pytest.skip("the page cache kept trunk.bin (DONTNEED not honoured here)")
    return r


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with Store.open(tiny_store(tmp_path_factory.mktemp("trunk"))) as st:
        yield st


def test_populate_faults_the_whole_trunk_in(store):
    r = cold_reader(store)
    r.populate()
    assert resident(r) == 1.0


def test_prefetch_reads_it_in_the_background_but_the_row_tables(store):
    """The untied token embedding is read a row a token and not counted resident: prefetch
    leaves it out, and a lookup reads its own pages, not the drive's read-ahead around them."""
    r = cold_reader(store)
    assert r.row_tables == ["token_embd.weight"]
    page, rec = mmap.PAGESIZE, r.records["token_embd.weight"]
    rows = [(rec.offset // page * page, -(-(rec.offset + rec.nbytes) // page) * page)]
    r.prefetch()
    end = time.monotonic() + 30
    while resident(r, rows) < 1.0 and time.monotonic() < end:
        time.sleep(0.01)
    assert resident(r, rows) == 1.0
    inner = r.row_pages
    if not inner or inner[0][1] - inner[0][0] < 8 * page:
        pytest.skip("the tiny store's embedding spans too few pages")
    a, b = inner[0]
    assert not any(pages_in(r)[a // page:b // page])
    r._buf[a + 4 * page:a + 4 * page + 16].sum()                  # one row's bytes
    assert sum(pages_in(r)[a // page:b // page]) <= 2


def test_populate_touches_every_page_where_the_kernel_refuses_the_advice(store, monkeypatch):
    from expertfs.runtime.model import weights
    monkeypatch.setattr(weights, "MADV_POPULATE_READ", 0x7fff)      # EINVAL: not an advice
    r = cold_reader(store)
    r.populate()
    assert resident(r) == 1.0


def test_a_closed_reader_advises_no_further(store):
    r = TrunkReader(store)
    r.close()
    calls = []
    r._mm = type("Map", (), {"__len__": lambda self: 3 << 26,
                             "madvise": lambda self, *a: calls.append(a)})()
    assert r._advise(mmap.MADV_WILLNEED) and not calls


def test_populate_reads_the_row_tables_with_the_rest(store):
    """A populate makes the row tables resident too: it lifts their page-at-a-time advice first,
    so the kernel reads them in its read-ahead as the rest of the trunk, not 4 KiB a fault."""
    r = TrunkReader(store)
    rows = r.row_pages
    calls = []
    r._mm = type("Map", (), {"__len__": lambda self: len(r._buf),
                             "madvise": lambda self, *a: calls.append(a)})()
    r.populate()
    assert rows and calls[:len(rows)] == [(mmap.MADV_NORMAL, a, b - a) for a, b in rows]
    assert all(c[0] != mmap.MADV_RANDOM for c in calls)


def test_f32_tensors_are_views_of_the_map_not_copies(store):
    """An F32 tensor loaded in float32 on the CPU (norms, routers) reads the mapped trunk in
    place: file pages a cap can evict, not an anonymous copy beside them. Other types, and
    other dtypes, are copies."""
    import torch
    from expertfs.formats.dequant import dequantize
    from expertfs.formats.ggml import GGMLType
    r = TrunkReader(store)
    lo, hi = r.base_address, r.base_address + r.mapped_bytes
    cpu = torch.device("cpu")
    kinds = set()
    for name in r.records:
        t = r.get(name)
        f = t.to_float(torch.float32, cpu)
        assert f.shape == t.shape and f.is_contiguous()
        assert torch.equal(f, dequantize(t.raw, t.ggml_type, t.shape))
        inside = lo <= f.data_ptr() < hi
        assert inside == (t.ggml_type == GGMLType.F32), name
        kinds.add(t.ggml_type == GGMLType.F32)
        if t.ggml_type == GGMLType.F32:
            assert not lo <= t.to_float(torch.bfloat16, cpu).data_ptr() < hi
    assert kinds == {True, False}
