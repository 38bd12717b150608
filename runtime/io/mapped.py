"""The experts file mapped into memory, its ranges read by faulting them in: the page cache as
the RAM tier where that tier holds every expert.

A tier with a slot for every expert never evicts, so it needs no slots of its own: each expert
can stay where the file puts it. ``FileMapping`` maps the whole file once (``MAP_PRIVATE``: a
write, which the engine never makes, would copy the page, never reach the file) and "reads" an
extent with ``madvise(MADV_POPULATE_READ)``: the kernel reads the range into the page cache
(where it is not there already) and maps those pages, with nothing copied and no page of
anonymous memory cleared first. Where the page cache holds the file (an earlier mapped run, a
copy, another reader), that is no read at all, where a slab would read the whole model again
into fresh memory taken from that same page cache; cold, a mapped tier's reads go through the
page cache, whose work the nice-19 warm start most likely cannot keep off the cores the decode
runs on (a slower GLM-5.3 decode), so the cache layer maps only a file mostly cached
(``cache.slots.host_tier``; bench/README.md "The mapped RAM tier"). Linux 5.14 or later;
``populate_supported()`` probes it once.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import warnings
from typing import Any

import torch

from .buffers import MADV_POPULATE_READ, libc
from .errors import IOUsageError

__all__ = ["FileMapping", "page_cache_share", "populate_supported"]


@functools.lru_cache(maxsize=1)
def populate_supported() -> bool:
    """True where ``madvise(MADV_POPULATE_READ)`` works (Linux 5.14+)."""
    lib = libc()
    if lib is None or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    m = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        buf = (ctypes.c_char * mmap.PAGESIZE).from_buffer(m)
        ok = lib.madvise(ctypes.addressof(buf), mmap.PAGESIZE, MADV_POPULATE_READ) == 0
        del buf
    finally:
        m.close()
    return ok


def page_cache_share(path: str | os.PathLike[str]) -> float:
    """The fraction of the file at ``path`` the page cache holds now
    (``FileMapping.cached_fraction``: the file mapped for the question only); 0.0 where it
    cannot be mapped or the kernel cannot say."""
    try:
        m = FileMapping(path)
    except (OSError, ValueError, IOUsageError):
        return 0.0
    try:
        return m.cached_fraction()
    finally:
        m.close()


class FileMapping:
    """``path`` mapped whole, private and read-write (copy on write), as a flat uint8 tensor.

    ``view(offset, n)`` is the tensor's slice of the file's bytes ``[offset, offset + n)``;
    ``at(buf)`` the file offset a buffer starts at when it lies in the mapping (else None);
    ``populate(offset, n)`` faults the range in, reading it through the page cache. The mapping
    lives as long as any view of it (``close`` drops this object's own reference)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise IOUsageError("cannot map an empty file", path=self.path,
                                   fix="the store is damaged: run `expertfs verify`, repack")
            m = mmap.mmap(fd, self.size, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)                           # the mapping keeps its own reference
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.tensor: torch.Tensor | None = torch.frombuffer(m, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()
        # the file's pages in 2 MiB folios, each mapped by one page-table entry as the slab's
        # transparent huge pages are: with 4 KiB mappings every page costs the products a TLB
        # miss (a two-dimensional page walk under a hypervisor). Only pages the page cache
        # reads from now on are made that size; pages already cached keep theirs.
        lib = libc()
        if lib is not None and hasattr(mmap, "MADV_HUGEPAGE"):
            lib.madvise(self.base, self.size, mmap.MADV_HUGEPAGE)

    def view(self, offset: int, n: int) -> torch.Tensor:
        if self.tensor is None:
            raise IOUsageError("view of a closed mapping", path=self.path,
                               fix="map the file again")
        if offset < 0 or n < 0 or offset + n > self.size:
            raise IOUsageError(f"range [{offset}, {offset + n}) is outside the mapped file of "
                               f"{self.size} bytes", path=self.path,
                               fix="the store is damaged: run `expertfs verify`, repack")
        return self.tensor[offset:offset + n]

    def at(self, buf: Any) -> int | None:
        """The file offset ``buf`` (a CPU tensor) starts at if it lies in this mapping."""
        if self.tensor is None or not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
            return None
        off = buf.data_ptr() - self.base
        return off if 0 <= off and off + buf.numel() * buf.element_size() <= self.size else None

    def populate(self, offset: int, n: int) -> int:
        """Fault ``[offset, offset + n)`` in (the reads it takes, through the page cache);
        returns ``n``. Raises ``OSError`` when the kernel refuses (an I/O error, no memory).

        The range is first advised ``MADV_WILLNEED``: the kernel queues the read-ahead of all
        of it at once, in large requests, so the faults then wait for reads already in flight
        instead of each issuing the next read-ahead window (a cold 64-token prompt 2.6 s
        against 4.6 s without it, bench/README.md "The mapped RAM tier")."""
        lib = libc()
        if lib is None or self.tensor is None:
            raise OSError("madvise is not available")
        lib.madvise(self.base + offset, n, mmap.MADV_WILLNEED)  # advice: a refusal is harmless
        if lib.madvise(self.base + offset, n, MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_POPULATE_READ) of {n} bytes at {offset} in "
                               f"{self.path}: {os.strerror(err)}")
        return n

    def cached_fraction(self, samples: int = 4096) -> float:
        """The fraction of the file the page cache holds now, from ``samples`` pages spread
        evenly over it (``mincore``: one system call a page, milliseconds whatever the size);
        0.0 where the kernel cannot say."""
        lib = libc()
        if lib is None or self.tensor is None:
            return 0.0
        page = mmap.PAGESIZE
        pages = -(-self.size // page)
        picks = sorted({i * pages // min(samples, pages) for i in range(min(samples, pages))})
        vec = ctypes.c_ubyte()
        held = 0
        for p in picks:
            if lib.mincore(self.base + p * page, page, ctypes.byref(vec)) != 0:
                return 0.0
            held += vec.value & 1
        return held / len(picks)

    def close(self) -> None:
        self.tensor = None
