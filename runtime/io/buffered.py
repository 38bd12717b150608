"""``buffered``: ``pread`` through the page cache, the baseline every user already has.

By default the file is advised ``POSIX_FADV_RANDOM``: the engine reads whole extents at
random, so kernel readahead past an extent's end only reads the neighbouring expert for
nothing (llama.cpp under memory pressure reads several times what it needs with the default
readahead; see bench/README.md).
"""

from __future__ import annotations

import os
from typing import Any

from .protocol import IOBackend, RawFile, open_fd

__all__ = ["BufferedBackend"]


class _BufferedFile(RawFile):
    def __init__(self, path: str, fd: int, size: int) -> None:
        super().__init__(path, size)
        self.fd = fd

    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        return os.preadv(self.fd, [dest[start:end]], file_offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BufferedBackend(IOBackend):
    name = "buffered"

    def __init__(self, *, fadvise_random: bool = True) -> None:
        self.fadvise_random = fadvise_random

    def describe(self) -> str:
        return f"buffered (pread via page cache, fadvise {'RANDOM' if self.fadvise_random else 'NORMAL'})"

    def open_raw(self, path: str | os.PathLike[str]) -> RawFile:
        path, fd, size = open_fd(path)
        if self.fadvise_random and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return _BufferedFile(path, fd, size)
