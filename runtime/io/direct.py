"""``direct``: O_DIRECT reads, bypassing the page cache, through the handle's thread pool.

Aligned reads (buffer address, file offset and length on ``alignment``) go straight into the
destination. The rest is read correctly through a per-thread aligned bounce buffer: an
unaligned tail of an aligned read costs one extra block, an unaligned buffer or offset costs a
copy of the whole read (logged once per file; ``strict=True`` raises instead).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Any

from .buffers import PAGE, address_of, aligned_empty, host_view
from .errors import AlignmentError, BackendUnavailable, IOUsageError
from .protocol import Availability, IOBackend, RawFile, open_fd

__all__ = ["DirectBackend"]

log = logging.getLogger(__name__)

_BOUNCE = 1 << 20


class _DirectFile(RawFile):
    def __init__(self, path: str, fd: int, size: int, *, alignment: int, strict: bool) -> None:
        super().__init__(path, size)
        self.fd = fd
        self.alignment = alignment
        self.strict = strict
        self.bounced = 0              # reads (or read pieces) that went through the bounce buffer
        self._local = threading.local()
        self._warned = False

    def _scratch(self) -> memoryview:
        mv = getattr(self._local, "scratch", None)
        if mv is None:
            mv = host_view(aligned_empty(_BOUNCE, alignment=self.alignment))
            self._local.scratch = mv
        return mv

    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        a = self.alignment
        view = dest[start:end]
        n = end - start
        if file_offset % a == 0 and address_of(view) % a == 0:
            body = n - n % a
            if body:
                return os.preadv(self.fd, [view[:body]], file_offset)
            if self.strict:
                raise AlignmentError(f"O_DIRECT read of {n} bytes at offset {file_offset}: the "
                                     f"length is not a multiple of {a}", path=self.path,
                                     fix="read whole aligned extents, or use strict=False")
        elif self.strict:
            raise AlignmentError(f"O_DIRECT read at offset {file_offset} into a buffer at "
                                 f"{address_of(view):#x}: both must be multiples of {a}",
                                 path=self.path,
                                 fix="allocate buffers with aligned_empty() and read at aligned "
                                     "offsets, or use strict=False")
        elif not self._warned and n >= a:
            self._warned = True
            log.warning("%s: O_DIRECT read at offset %d into a buffer at %#x is off the %d-byte "
                        "alignment; bouncing through a scratch buffer (slower). Allocate with "
                        "expertfs.runtime.io.aligned_empty.", self.path, file_offset,
                        address_of(view), a)
        return self._bounce(view, file_offset)

    def _bounce(self, view: memoryview, file_offset: int) -> int:
        a = self.alignment
        scratch = self._scratch()
        lo = file_offset - file_offset % a
        skip = file_offset - lo
        span = min(len(scratch), -(-(skip + len(view)) // a) * a)
        got = os.preadv(self.fd, [scratch[:span]], lo)
        n = max(0, min(len(view), got - skip))
        view[:n] = scratch[skip:skip + n]
        self.bounced += 1
        return n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DirectBackend(IOBackend):
    name = "direct"

    def __init__(self, *, alignment: int = PAGE, strict: bool = False) -> None:
        if alignment <= 0 or alignment & (alignment - 1) or alignment > _BOUNCE:
            raise IOUsageError(f"O_DIRECT alignment {alignment} is not a power of two up to 1 MiB",
                               fix="use 4096 (NVMe) or 512")
        self.alignment = alignment
        self.strict = strict

    @classmethod
    def availability(cls) -> Availability:
        if not hasattr(os, "O_DIRECT"):
            return Availability(False, "this platform has no O_DIRECT")
        return Availability(True, "O_DIRECT is defined; the file system decides at open")

    def describe(self) -> str:
        return f"direct (O_DIRECT, {self.alignment}-byte aligned, thread pool)"

    def open_raw(self, path: str | os.PathLike[str]) -> RawFile:
        if not hasattr(os, "O_DIRECT"):
            raise BackendUnavailable(self.name, "this platform has no O_DIRECT", path=path,
                                     fix="use backend='buffered'")
        try:
            path, fd, size = open_fd(path, os.O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise BackendUnavailable(self.name, "the file system refuses O_DIRECT (tmpfs, "
                                         "some overlay and network file systems)", path=path,
                                         fix="keep the store on a local disk file system, or use "
                                             "backend='buffered'") from None
            raise
        return _DirectFile(path, fd, size, alignment=self.alignment, strict=self.strict)
