"""``mmap``: copy out of a read-only mapping, llama.cpp's way of reading a model. A baseline
for benchmarks; ``auto`` never picks it (page faults read in readahead-sized pieces and the
mapping's pages compete with the engine's own cache for RAM)."""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from .protocol import IOBackend, RawFile, open_fd

__all__ = ["MmapBackend"]


class _MmapFile(RawFile):
    def __init__(self, path: str, fd: int, size: int) -> None:
        super().__init__(path, size)
        self.fd = fd
        self._mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        self._arr = (np.frombuffer(self._mm, dtype=np.uint8) if self._mm is not None
                     else np.empty(0, np.uint8))

    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        n = max(0, min(end - start, self.size - file_offset))
        # numpy copies without the GIL, so page faults of several reads overlap
        np.copyto(np.frombuffer(dest[start:start + n], dtype=np.uint8),
                  self._arr[file_offset:file_offset + n])
        return n

    def close(self) -> None:
        if self.fd >= 0:
            self._arr = np.empty(0, np.uint8)
            if self._mm is not None:
                self._mm.close()
            os.close(self.fd)
            self.fd = -1


class MmapBackend(IOBackend):
    name = "mmap"

    def describe(self) -> str:
        return "mmap (page faults through the page cache, default readahead)"

    def open_raw(self, path: str | os.PathLike[str]) -> RawFile:
        return _MmapFile(*open_fd(path))
