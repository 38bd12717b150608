"""``auto`` measures the candidates on the file, picks, says why, caches the probe, and falls
back (saying so) when kvikio cannot run."""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys

import numpy as np
import pytest

from expertfs.runtime.io import (BackendUnavailable, IOUsageError, KvikioBackend, aligned_empty,
                                 choose_backend, open_file)
from expertfs.runtime.io.auto import AutoChoice, _pick, capped_choice
from expertfs.runtime.io.pagecache import drop_file_cache


@pytest.fixture
def big(tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())    # clean pages: fadvise(DONTNEED) drops only those, not the
    return path                 # dirty ones still waiting for writeback on a busy disk


def test_choose_measures_logs_and_caches(big, tmp_path, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="expertfs.runtime.io.auto"):
        c = choose_backend(big, read_size=256 << 10, probe_bytes=2 << 20, cache_dir=cache)
    assert c.backend in ("direct", "buffered", "kvikio") and not c.cached
    assert {"direct", "buffered"} <= set(c.gbps) and all(g > 0 for g in c.gbps.values())
    assert "GB/s" in c.reason and f"auto backend for {big}: {c.backend}" in caplog.text
    assert (cache / "io-probe.json").is_file()
    again = choose_backend(big, read_size=256 << 10, probe_bytes=2 << 20, cache_dir=cache)
    assert again.cached and again.backend == c.backend and again.gbps == c.gbps
    fresh = choose_backend(big, read_size=256 << 10, probe_bytes=2 << 20, cache_dir=cache,
                           refresh=True)
    assert not fresh.cached


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None,
                    reason="this machine has a CUDA driver; the fallback is not exercised")
def test_auto_falls_back_without_the_driver_and_says_so(big, tmp_path, caplog):
    avail = KvikioBackend.availability()
    assert not avail.available
    assert ("libcuda.so.1" in avail.reason) or ("not installed" in avail.reason)
    with caplog.at_level(logging.INFO):
        c = choose_backend(big, read_size=256 << 10, probe_bytes=1 << 20, cache_dir=tmp_path)
    assert c.backend != "kvikio" and "kvikio" in c.skipped and "kvikio" in c.reason
    assert "auto: kvikio not used" in caplog.text
    with pytest.raises(BackendUnavailable, match="kvikio"):
        KvikioBackend().open(big)


def test_tie_break_prefers_direct_then_the_fastest():
    assert _pick({"direct": 1.0, "buffered": 1.12}) == "direct"
    assert _pick({"direct": 1.0, "buffered": 1.3}) == "buffered"


def test_kvikio_only_when_it_measured_faster():
    """kvikio reads into host slots like the POSIX backends: no tie preference (issue 17)."""
    assert _pick({"kvikio": 0.9, "direct": 1.0}) == "direct"
    assert _pick({"kvikio": 1.0, "direct": 1.0, "buffered": 0.5}) == "direct"
    assert _pick({"kvikio": 1.0, "direct": 0.8, "buffered": 1.05}) == "buffered"
    assert _pick({"kvikio": 1.01, "direct": 1.0}) == "kvikio"
    assert _pick({"kvikio": 0.5}) == "kvikio"


def test_open_file_auto_and_small_files(big, tmp_path):
    with open_file(big, backend="auto", read_size=256 << 10, cache_dir=tmp_path) as fh:
        assert fh.choice is not None and fh.backend_name == fh.choice.backend
        buf = aligned_empty(4096)
        fh.read(buf, 8192)
        assert buf.numpy().tobytes() == big.read_bytes()[8192:12288]
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 5000)
    with open_file(small, cache_dir=tmp_path) as fh:
        assert fh.backend_name == "buffered" and "too small" in fh.choice.reason
    with open_file(small, backend="direct") as fh:
        assert fh.choice is None
    with pytest.raises(IOUsageError, match="not known"):
        choose_backend(big, candidates=["floppy"], cache_dir=tmp_path, refresh=True)


def _cached_pages(path, start: int, length: int) -> int:
    """Pages of ``path``'s [start, start + length) in the page cache (``mincore`` on a private
    mapping: an untouched page of it is the file's cached page, or none)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            base = ctypes.c_char.from_buffer(m)
            vec = (ctypes.c_ubyte * (length // page))()
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(base) + start),
                              ctypes.c_size_t(length), vec)
            del base
            assert rc == 0, ctypes.get_errno()
            return sum(v & 1 for v in vec)
        finally:
            m.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not sys.platform.startswith("linux"),
                    reason="needs posix_fadvise and mincore (Linux)")
@pytest.mark.parametrize("drop", [False, True])
def test_buffered_drop_behind_keeps_no_page_cached(big, tmp_path, drop):
    """``drop_behind`` (a run under a memory cap): a buffered read's pages leave the page
    cache once copied; without it they stay. Auto's pick of buffered says why, as others."""
    drop_file_cache(big)
    with open_file(big, backend="buffered", drop_behind=drop) as fh:
        buf = aligned_empty(1 << 20)
        fh.read(buf, 1 << 20)
        assert buf.numpy().tobytes() == big.read_bytes()[1 << 20:2 << 20]
    drop_file_cache(big)       # big.read_bytes() above cached the whole file
    with open_file(big, backend="buffered", drop_behind=drop) as fh:
        fh.read(aligned_empty(1 << 20), 1 << 20)
        cached = _cached_pages(big, 1 << 20, 1 << 20)
    assert (cached == 0) if drop else cached > 0
    c = choose_backend(big, candidates=["buffered"], read_size=256 << 10, probe_bytes=2 << 20,
                       cache_dir=tmp_path, refresh=True)
    assert c.backend == "buffered" and "kvikio reads" not in c.reason


def test_under_a_cap_auto_reads_direct_where_it_can(big, tmp_path):
    """``drop_behind`` (a memory cap): buffered's pick becomes direct where the probe read with
    both; a pick without direct, or of direct, stays."""
    both = AutoChoice("buffered", "buffered 1.1 GB/s, direct 0.8 GB/s", {"buffered": 1.1,
                                                                       "direct": 0.8})
    c = capped_choice(both)
    assert c.backend == "direct" and "memory cap" in c.reason
    alone = AutoChoice("buffered", "only buffered", {"buffered": 1.0})
    assert capped_choice(alone) is alone and capped_choice(c) is c
    with open_file(big, backend="auto", read_size=256 << 10, cache_dir=tmp_path,
                   drop_behind=True) as fh:
        assert fh.backend_name == "direct" or "direct" not in fh.choice.gbps
