"""The one I/O protocol every backend speaks.

A backend (:class:`IOBackend`) opens a :class:`RawFile`: one blocking attempt to read a byte
range into a destination, which may come back short. :class:`FileHandle` is the same for every
backend on top of it: ``pread(buf, offset, size) -> ReadFuture`` through a bounded, prioritised
queue (:mod:`.scheduler`), short reads continued and faults retried (:mod:`.retry`), and the
blocking ``read = pread().result()``.

Alignment contract (stated once here): the fast path of the ``direct`` backend needs the buffer
address, the file offset and the length on the backend's alignment (4 KiB); anything else is
still read correctly but goes through a bounce buffer. Store extents always meet it, and
:func:`.buffers.aligned_empty` buffers always do.
"""

from __future__ import annotations

import logging
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .buffers import host_view, is_device_buffer, nbytes_of
from .errors import IOEngineError, IOUsageError
from .retry import RetryPolicy, read_fully
from .scheduler import Priority, ReadFuture, ReadScheduler

__all__ = ["Availability", "RawFile", "IOBackend", "FileHandle", "DEFAULT_QUEUE_DEPTH", "open_fd"]

log = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH = 8


def open_fd(path: str | os.PathLike[str], flags: int = 0) -> tuple[str, int, int]:
    """``os.open(path, O_RDONLY | flags)`` -> (path, fd, size), a typed error when it fails."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IOUsageError("is a directory, not a file", path=path,
                               fix="name the file (a store's experts.bin) or open it as a store")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | flags)
    except FileNotFoundError:
        raise IOUsageError("no such file", path=path, fix="check the path") from None
    except PermissionError:
        raise IOUsageError("permission denied", path=path, fix="make the file readable") from None
    try:
        size = os.fstat(fd).st_size
    except OSError:
        os.close(fd)
        raise
    return path, fd, size


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str


class RawFile(ABC):
    """An open file of one backend. ``pread_into`` is a single attempt and may return short."""

    #: True when destinations must be host memory (a ``memoryview`` is passed to pread_into)
    host_only: ClassVar[bool] = True

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size

    def prepare(self, buf: Any) -> Any:
        """Turn a user buffer into what ``pread_into`` takes (a flat byte memoryview here)."""
        if is_device_buffer(buf):
            raise IOUsageError(f"the destination is device memory but backend "
                               f"{type(self).__name__} reads into host memory only",
                               path=self.path,
                               fix="read into a (pinned) host slot and copy, or use backend='kvikio'")
        return host_view(buf)

    @abstractmethod
    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        """Read file bytes from ``file_offset`` into ``dest[start:end]``; return the count."""

    @abstractmethod
    def close(self) -> None: ...


class IOBackend(ABC):
    """A way to read a file. Subclasses set ``name`` and implement ``open_raw``."""

    name: ClassVar[str]

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "always available")

    @abstractmethod
    def open_raw(self, path: str | os.PathLike[str]) -> RawFile: ...

    def describe(self) -> str:
        """One line on how this backend reads (mode, threads), for logs and reports."""
        return self.name

    def open(self, path: str | os.PathLike[str], *, queue_depth: int = DEFAULT_QUEUE_DEPTH,
             max_pending: int | None = None, retry: RetryPolicy | None = None) -> FileHandle:
        return FileHandle(self.open_raw(path), backend=self, queue_depth=queue_depth,
                          max_pending=max_pending, retry=retry)


class FileHandle:
    """An open file with many reads in flight. Use as a context manager or call ``close()``."""

    def __init__(self, raw: RawFile, *, backend: IOBackend, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 max_pending: int | None = None, retry: RetryPolicy | None = None) -> None:
        self.raw = raw
        self.backend = backend
        self.path = raw.path
        self.size = raw.size
        self.queue_depth = queue_depth
        self.retry = retry or RetryPolicy()
        try:
            self.scheduler = ReadScheduler(queue_depth, max_pending=max_pending,
                                           name=f"io-{backend.name}", background_workers=1)
        except BaseException:
            raw.close()
            raise
        self.choice: Any = None            # the AutoChoice when opened by backend='auto'
        self._closed = False

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def check_range(self, buf: Any, offset: int, size: int | None) -> int:
        """Validate a read and return its size (``None``: the whole buffer)."""
        cap = nbytes_of(buf)
        size = cap if size is None else size
        if offset < 0 or size < 0:
            raise IOUsageError(f"read of {size} bytes at offset {offset}: both must be >= 0",
                               path=self.path, fix="pass a non-negative offset and size")
        if size > cap:
            raise IOUsageError(f"read of {size} bytes into a buffer of {cap} bytes", path=self.path,
                               fix="allocate a buffer at least as large as the read")
        if offset + size > self.size:
            raise IOUsageError(f"read of {size} bytes at offset {offset} ends past the end of the "
                               f"file ({self.size} bytes)", path=self.path,
                               fix="check the offset and size (a truncated store file? run "
                                   "`expertfs verify`)")
        return size

    def pread(self, buf: Any, offset: int, size: int | None = None, *,
              priority: Priority = Priority.DEMAND, tag: Any = None,
              then: Callable[[int], Any] | None = None, block: bool = True,
              fail: Callable[[IOEngineError], BaseException] | None = None) -> ReadFuture:
        """Queue a read of ``size`` bytes at ``offset`` into ``buf``; the future's result is the
        byte count, or ``then(count)`` run on the worker thread when given (e.g. a checksum).
        ``fail`` turns a read that failed after its retries into the error the future raises
        (e.g. one naming what was being read)."""
        if self._closed:
            raise IOUsageError("read on a closed file", path=self.path, fix="open the file again")
        size = self.check_range(buf, offset, size)
        dest, raw = self.raw.prepare(buf), self.raw
        return self._submit(lambda s, e, o: raw.pread_into(dest, s, e, o), offset, size,
                            priority=priority, tag=tag, then=then, block=block, fail=fail)

    def populate(self, mapping: Any, offset: int, size: int, *,
                 priority: Priority = Priority.DEMAND, tag: Any = None,
                 then: Callable[[int], Any] | None = None,
                 fail: Callable[[IOEngineError], BaseException] | None = None) -> ReadFuture:
        """``pread``'s queue, priorities, retries and errors for a read into ``mapping`` (a
        ``mapped.FileMapping`` of this file) at the file's own place: the range faulted in
        through the page cache instead of copied into a buffer."""
        if self._closed:
            raise IOUsageError("read on a closed file", path=self.path, fix="open the file again")
        return self._submit(lambda s, e, o: mapping.populate(o, e - s), offset, size,
                            priority=priority, tag=tag, then=then, block=True, fail=fail)

    def _submit(self, read: Callable[[int, int, int], int], offset: int, size: int, *,
                priority: Priority, tag: Any, then: Callable[[int], Any] | None, block: bool,
                fail: Callable[[IOEngineError], BaseException] | None) -> ReadFuture:
        """Queue ``read_fully(read, ...)`` of ``size`` bytes at ``offset``, then ``then``."""
        path, policy = self.path, self.retry

        def job() -> Any:
            try:
                n = read_fully(read, path=path, offset=offset, size=size, policy=policy)
            except IOEngineError as e:
                if fail is None:
                    raise
                raise fail(e) from e
            return then(n) if then is not None else n

        return self.scheduler.submit(job, priority=priority, tag=tag, block=block, nbytes=size)

    def read_now(self, buf: Any, offset: int, size: int) -> int:
        """Read in the calling thread, past the queue (a worker re-reading what it just read)."""
        size = self.check_range(buf, offset, size)
        dest = self.raw.prepare(buf)
        return read_fully(lambda s, e, o: self.raw.pread_into(dest, s, e, o), path=self.path,
                          offset=offset, size=size, policy=self.retry)

    def read(self, buf: Any, offset: int, size: int | None = None) -> int:
        """Blocking read: ``pread(...).result()``."""
        return self.pread(buf, offset, size).result()

    def cancel_pending(self, predicate: Callable[[ReadFuture], bool] | None = None, *,
                       min_priority: Priority = Priority.PREFETCH) -> int:
        return self.scheduler.cancel_pending(predicate, min_priority=min_priority)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.scheduler.close()
        self.raw.close()

    def __enter__(self) -> FileHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileHandle({self.path!r}, backend={self.backend.name!r}, qd={self.queue_depth})"
