"""Micro benchmarks of the I/O engine (pytest-benchmark; not part of the test suite).

    pytest bench/test_io_micro.py --benchmark-columns=min,median,mean,ops -q

Per-read CPU overhead of the engine = ``handle_read_4k_cached`` - ``raw_preadv_4k_cached``
(the same page-cached 4 KiB read without the queue, thread hand-off and future), and the
amortised ``batch64`` variants with many reads in flight. ``direct_4k`` is the small-read
latency of the device itself (O_DIRECT always reaches it).
"""

from __future__ import annotations

import os

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

import numpy as np
import pytest

from expertfs.runtime.io import (ExpertReader, Priority, ReadScheduler, aligned_empty,
                                 get_backend, host_view)

pytest.importorskip("pytest_benchmark")


@pytest.fixture(scope="module")
def cached_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("iobench") / "f.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes())
    with open(path, "rb") as f:          # warm the page cache
        while f.read(1 << 20):
            pass
    return str(path)


def test_raw_preadv_4k_cached(benchmark, cached_file):
    fd = os.open(cached_file, os.O_RDONLY)
    mv = host_view(aligned_empty(4096))
    benchmark(os.preadv, fd, [mv], 8192)
    os.close(fd)


def test_handle_read_4k_cached(benchmark, cached_file):
    with get_backend("buffered").open(cached_file, queue_depth=1) as fh:
        buf = aligned_empty(4096)
        benchmark(fh.read, buf, 8192, 4096)


@pytest.mark.parametrize("qd", [1, 4, 16])
def test_handle_batch64_4k_cached(benchmark, cached_file, qd):
    """64 reads submitted at once, then all awaited: divide by 64 for the per-read cost."""
    with get_backend("buffered").open(cached_file, queue_depth=qd) as fh:
        bufs = [aligned_empty(4096) for _ in range(64)]

        def batch():
            futs = [fh.pread(b, i * 4096, 4096) for i, b in enumerate(bufs)]
            for f in futs:
                f.result()

        benchmark(batch)


def test_scheduler_submit_complete_noop(benchmark):
    s = ReadScheduler(1)
    benchmark(lambda: s.submit(lambda: None, priority=Priority.DEMAND).result())
    s.close()


def test_direct_4k(benchmark, cached_file):
    """Small-read latency of the device (O_DIRECT bypasses the page cache)."""
    with get_backend("direct").open(cached_file, queue_depth=1) as fh:
        buf = aligned_empty(4096)
        rng = np.random.default_rng(1)
        offs = iter((rng.integers(0, (16 << 20) // 4096, 1 << 20) * 4096).tolist())
        benchmark(lambda: fh.read(buf, next(offs), 4096))


def test_expert_read_verified_cached(benchmark, tmp_path):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_io_reader import write_expert_file
    extents = write_expert_file(tmp_path / "experts.bin", layers=1, experts=4,
                                part_sizes=(1 << 20, 1 << 20, 1 << 20))
    with ExpertReader(path=tmp_path / "experts.bin", extents=extents, backend="buffered",
                      verify="always") as r:
        slot = aligned_empty(extents[0].length)
        benchmark(lambda: r.read_expert(0, 1, into=slot).result())
