"""Whole-range reads for the store's own tools (verify, unpack): complete or a typed error.

``read_ranges`` streams many ranges of one file through a small pool of reusable buffers, one
read ahead, dropping pages from the page cache after use so checking a store larger than RAM
does not evict everything else. (The runtime's I/O engine lives in ``expertfs.runtime.io``.)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

from ..errors import ExpertfsError, StoreError

__all__ = ["pread_full", "read_ranges", "chunked", "READ_CHUNK"]

READ_CHUNK = 16 << 20


def pread_full(fd: int, n: int, off: int, path: str) -> bytes:
    """Exactly ``n`` bytes at ``off``; a ``StoreError`` naming the file if it ends early."""
    buf = bytearray(n)
    mv = memoryview(buf)
    pos = 0
    try:
        while pos < n:
            got = os.preadv(fd, [mv[pos:]], off + pos)
            if got == 0:
                raise StoreError(f"ends at byte {off + pos}, expected data up to {off + n}",
                                 path=path, fix="the file is truncated; repack again")
            pos += got
    except OSError as e:
        raise ExpertfsError(f"read failed at byte {off + pos}: {e.strerror}", path=path,
                            fix="check the disk (dmesg) and retry") from None
    finally:
        mv.release()
    return bytes(buf)


def read_ranges(path: str, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, bytes)`` for each ``(offset, length)`` in order, reading one ahead."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertfs-check") as pool:
            fut = None
            for i, (off, n) in enumerate(ranges):
                if fut is None:
                    fut = pool.submit(pread_full, fd, n, off, path)
                data = fut.result()
                fut = pool.submit(pread_full, fd, ranges[i + 1][1], ranges[i + 1][0], path) \
                    if i + 1 < len(ranges) else None
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
                yield off, data
    finally:
        os.close(fd)


def chunked(off: int, n: int, chunk: int = READ_CHUNK) -> list[tuple[int, int]]:
    return [(off + i, min(chunk, n - i)) for i in range(0, n, chunk)]
