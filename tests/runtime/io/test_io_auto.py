"""``auto`` measures the candidates on the file, picks, says why, caches the probe, and falls
back (saying so) when kvikio cannot run."""

from __future__ import annotations

import ctypes.util
import logging

import numpy as np
import pytest

from expertfs.runtime.io import (BackendUnavailable, IOUsageError, KvikioBackend, aligned_empty,
                                 choose_backend, open_file)
from expertfs.runtime.io.auto import _pick


@pytest.fixture
def big(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    return path


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
