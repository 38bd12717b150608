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


def resident(reader: TrunkReader) -> float:
    """The share of the map's pages in memory (mincore)."""
    mm = reader._mm
    n = (len(mm) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)), vec) == 0
    return sum(v & 1 for v in vec) / n


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


def test_prefetch_reads_it_in_the_background(store):
    r = cold_reader(store)
    r.prefetch()
    end = time.monotonic() + 30
    while resident(r) < 1.0 and time.monotonic() < end:
        time.sleep(0.01)
    assert resident(r) == 1.0


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
