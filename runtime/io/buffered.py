"""``buffered``: ``pread`` through the page cache, the baseline every user already has.

By default the file is advised ``POSIX_FADV_RANDOM``: the engine reads whole extents at
random, so kernel readahead past an extent's end only reads the neighbouring expert for
nothing (llama.cpp under memory pressure reads several times what it needs with the default
readahead; see bench/README.md).

With ``drop_behind`` each read's pages are dropped from the page cache once copied out
(``POSIX_FADV_DONTNEED`` on the range): the engine runs so under a memory cap, which charges
the page cache to the process, where the reads' copies would otherwise take the room of the
memory-mapped trunk (evicted, then re-read from the drive every token).
"""

from __future__ import annotations

import os
from typing import Any

from .protocol import IOBackend, RawFile, open_fd

__all__ = ["BufferedBackend"]


class _BufferedFile(RawFile):
    def __init__(self, path: str, fd: int, size: int, drop_behind: bool = False) -> None:
        super().__init__(path, size)
        self.fd = fd
        self.drop_behind = drop_behind

    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        n = os.preadv(self.fd, [dest[start:end]], file_offset)
        if self.drop_behind and n > 0:
            os.posix_fadvise(self.fd, file_offset, n, os.POSIX_FADV_DONTNEED)
        return n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BufferedBackend(IOBackend):
    name = "buffered"

    def __init__(self, *, fadvise_random: bool = True, drop_behind: bool = False) -> None:
        self.fadvise_random = fadvise_random
        self.drop_behind = drop_behind and hasattr(os, "posix_fadvise")

    def describe(self) -> str:
        return (f"buffered (pread via page cache, fadvise {'RANDOM' if self.fadvise_random else 'NORMAL'}"
                + (", pages dropped after each read)" if self.drop_behind else ")"))

    def open_raw(self, path: str | os.PathLike[str]) -> RawFile:
        path, fd, size = open_fd(path)
        if self.fadvise_random and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return _BufferedFile(path, fd, size, self.drop_behind)
