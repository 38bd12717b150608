"""Expert reads: one extent = one read, checksummed, with demand reads ahead of prefetches.

:class:`ExpertReader` binds a store (anything with ``experts_path``, ``alignment`` and
``extent(layer, expert) -> Extent``, i.e. ``expertfs.store.reader.Store``) or a plain ``(path,
extents)`` pair to an open :class:`.protocol.FileHandle`. ``verify`` says when the parts'
xxh3 checksums are checked: ``"first"`` (default: the first read of each expert through this
reader), ``"always"`` or ``"never"``. At most ``max_bytes_in_flight`` bytes of reads run at
once (``READ_BYTES_IN_FLIGHT``), so the experts of a layer land in the order they were asked
for, one after another, rather than all together at the end. A mismatch is read again
(``rereads`` times: a fault on the way, not on the drive, goes away) and then raises
:class:`ExpertIntegrityError` naming the layer, expert and part; bytes that fail are never
handed out. A read that fails after the I/O
engine's retries raises :class:`IOFaultError` naming the expert. After every read the experts
file is checked to be the one opened (same inode, size and modification time): a store replaced,
truncated or rewritten under the reader raises :class:`StoreChangedError` instead of handing out
bytes that may not match the index.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

from expertfs.errors import StoreError
from expertfs.store.layout import Extent, Part

from .auto import open_file
from .buffers import aligned_empty, host_view, is_device_buffer, nbytes_of
from .errors import (ExpertIntegrityError, IOEngineError, IOFaultError, IOUsageError,
                     StoreChangedError)
from .mapped import FileMapping, populate_supported
from .protocol import DEFAULT_QUEUE_DEPTH, FileHandle, IOBackend
from .retry import RetryPolicy
from .scheduler import Priority, ReadFuture

__all__ = ["VERIFY_MODES", "ExpertBuffer", "ExpertReader", "part_bytes"]

log = logging.getLogger(__name__)

VERIFY_MODES = ("first", "always", "never")

#: The bytes of expert reads in flight at once (``ReadScheduler.max_bytes``; a larger expert is
#: read alone): enough requests to keep a drive busy (the block layer cuts each read into many),
#: few enough that a layer's experts land one after another, each computed while the next is read
#: (``bench/README.md``, the reads in the order they are asked for).
READ_BYTES_IN_FLIGHT = 16 << 20


def part_bytes(buf: Any, part: Part) -> Any:
    """The unpadded bytes of ``part`` inside an extent buffer (a view for host buffers)."""
    if is_device_buffer(buf):
        return buf.reshape(-1)[part.rel_offset:part.rel_offset + part.nbytes]
    return host_view(buf)[part.rel_offset:part.rel_offset + part.nbytes]


@dataclass(frozen=True)
class ExpertBuffer:
    """A read expert: its extent and the buffer holding the whole (padded) extent."""

    extent: Extent
    buffer: Any
    verified: bool

    def part(self, role: Any) -> Any:
        p = self.extent.part(role)
        if p is None:
            raise IOUsageError(f"expert (layer {self.extent.layer}, expert {self.extent.expert}) "
                               f"has no part {role!r}", fix="check the model's expert roles")
        return part_bytes(self.buffer, p)


class _Extents:
    """Extent lookup over a store-like object or a plain iterable of extents."""

    def __init__(self, store: Any, extents: Iterable[Extent] | None) -> None:
        self._store = store
        self._map = {(e.layer, e.expert): e for e in extents} if extents is not None else None

    def get(self, layer: int, expert: int, path: str) -> Extent:
        if self._map is not None:
            e = self._map.get((layer, expert))
            if e is None:
                raise IOUsageError(f"no extent for layer {layer}, expert {expert}", path=path,
                                   fix="check the layer and expert ids against the store")
            return e
        return self._store.extent(layer, expert)


class ExpertReader:
    def __init__(self, store: Any = None, *, path: str | os.PathLike[str] | None = None,
                 extents: Iterable[Extent] | None = None, alignment: int | None = None,
                 backend: str | IOBackend = "auto", queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 max_pending: int | None = None, verify: str = "first",
                 retry: RetryPolicy | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, rereads: int = 2,
                 drop_behind: bool = False,
                 max_bytes_in_flight: int | None = READ_BYTES_IN_FLIGHT) -> None:
        if verify not in VERIFY_MODES:
            raise IOUsageError(f"verify={verify!r} is not one of {', '.join(VERIFY_MODES)}",
                               fix="use 'first' (default), 'always' or 'never'")
        if store is None and (path is None or extents is None):
            raise IOUsageError("ExpertReader needs a store, or both path= and extents=",
                               fix="pass Store.open(dir), or the experts file and its extents")
        self.path = os.fspath(path if path is not None else store.experts_path)
        self.alignment = alignment or getattr(store, "alignment", None) or 4096
        self._extents = _Extents(store, extents)
        self.verify = verify
        self.rereads = max(0, int(rereads))
        self.handle: FileHandle = open_file(self.path, backend=backend, queue_depth=queue_depth,
                                            max_pending=max_pending, retry=retry,
                                            cache_dir=cache_dir, drop_behind=drop_behind)
        self.handle.scheduler.max_bytes = max_bytes_in_flight
        try:
            self._identity = _identity(os.stat(self.path))
        except OSError:
            self.handle.close()
            raise
        self._lock = threading.Lock()
        self._verified: set[tuple[int, int]] = set()
        self._inflight: dict[tuple[int, int], ReadFuture] = {}
        self._mapping: FileMapping | None = None
        self.stats = {"reads": 0, "bytes": 0, "verified": 0, "integrity_errors": 0, "joined": 0,
                      "rereads": 0, "recovered": 0}

    @property
    def backend_name(self) -> str:
        return self.handle.backend_name

    def extent(self, layer: int, expert: int) -> Extent:
        e = self._extents.get(layer, expert, self.path)
        a = self.alignment
        if e.offset % a or e.length % a or e.offset + e.length > self.handle.size:
            raise StoreError(f"extent of layer {layer}, expert {expert} ([{e.offset}, "
                             f"{e.offset + e.length})) is off the {a}-byte alignment or past the "
                             f"end of the file ({self.handle.size} bytes)", path=self.path,
                             fix="the store is damaged or truncated: run `expertfs verify`, repack")
        return e

    def alloc(self, extent: Extent) -> Any:
        """A buffer for one extent, aligned for O_DIRECT."""
        return aligned_empty(extent.length, alignment=self.alignment)

    def _mismatch(self, extent: Extent, buf: Any) -> tuple[Part, int] | None:
        for p in extent.parts:
            got = xxhash.xxh3_64_intdigest(self._host_bytes(part_bytes(buf, p)))
            if got != p.checksum:
                return p, got
        return None

    def _check(self, extent: Extent, buf: Any) -> None:
        """Checksum every part; on a mismatch read the extent again up to ``rereads`` times."""
        bad = self._mismatch(extent, buf)
        reads = 1
        while bad is not None and reads <= self.rereads:
            with self._lock:
                self.stats["rereads"] += 1
            log.warning("%s: expert (layer %d, expert %d) failed its checksum; reading it again",
                        self.path, extent.layer, extent.expert)
            self.handle.read_now(buf, extent.offset, extent.length)
            self.check_store(extent.layer, extent.expert)
            reads += 1
            bad = self._mismatch(extent, buf)
            if bad is None:
                with self._lock:
                    self.stats["recovered"] += 1
        if bad is None:
            return
        p, got = bad
        with self._lock:
            self.stats["integrity_errors"] += 1
        role = getattr(p.role, "name", str(p.role))
        raise ExpertIntegrityError(path=self.path, layer=extent.layer, expert=extent.expert,
                                   role=role, offset=extent.offset + p.rel_offset,
                                   nbytes=p.nbytes, expected=p.checksum, actual=got, attempts=reads)

    def check_store(self, layer: int | None = None, expert: int | None = None) -> None:
        """Raise :class:`StoreChangedError` if the experts file is no longer the one opened."""
        try:
            now = _identity(os.stat(self.path))
        except FileNotFoundError:
            raise StoreChangedError("the file was removed", path=self.path, layer=layer,
                                    expert=expert) from None
        change = _change(self._identity, now)
        if change:
            raise StoreChangedError(change, path=self.path, layer=layer, expert=expert)

    def _failed(self, layer: int, expert: int, err: IOEngineError) -> BaseException:
        """A read that failed after its retries: a changed store explains it first."""
        try:
            self.check_store(layer, expert)
        except StoreChangedError as changed:
            return changed
        return err.for_expert(layer, expert) if isinstance(err, IOFaultError) else err

    @staticmethod
    def _host_bytes(view: Any) -> Any:
        if is_device_buffer(view):
            return view.cpu().numpy()
        return view

    def read_expert(self, layer: int, expert: int, into: Any = None, *,
                    priority: Priority = Priority.DEMAND, verify: str | None = None) -> ReadFuture:
        """Queue the read of one expert's extent into ``into`` (allocated when ``None``).

        The future's result is an :class:`ExpertBuffer`. A read of an expert already queued
        into a buffer of the reader's choosing is joined (and promoted if more urgent) instead
        of read twice.
        """
        mode = verify or self.verify
        if mode not in VERIFY_MODES:
            raise IOUsageError(f"verify={mode!r} is not one of {', '.join(VERIFY_MODES)}",
                               fix="use 'first', 'always' or 'never'")
        key = (layer, expert)
        extent = self.extent(layer, expert)
        with self._lock:
            joined = self._inflight.get(key) if into is None else None
        if joined is not None and not joined.done():
            if priority < joined.priority:
                self.handle.scheduler.promote(joined, priority)
            with self._lock:
                self.stats["joined"] += 1
            return joined
        buf = self.alloc(extent) if into is None else into
        if nbytes_of(buf) < extent.length:
            raise IOUsageError(f"a buffer of {nbytes_of(buf)} bytes cannot hold expert (layer "
                               f"{layer}, expert {expert}): its extent is {extent.length} bytes",
                               path=self.path, fix="size slots to the largest extent of the store")

        def done(n: int) -> ExpertBuffer:
            self.check_store(layer, expert)
            check = mode == "always" or (mode == "first" and key not in self._verified)
            if check:
                self._check(extent, buf)
            with self._lock:
                self.stats["reads"] += 1
                self.stats["bytes"] += n
                if check:
                    self.stats["verified"] += 1
                    self._verified.add(key)
            return ExpertBuffer(extent, buf, check)

        def fail(err: IOEngineError) -> BaseException:
            return self._failed(layer, expert, err)

        m = self._mapping
        if m is not None and m.at(buf) == extent.offset:      # the file's own pages: fault in
            fut = self.handle.populate(m, extent.offset, extent.length, priority=priority,
                                       tag=key, then=done, fail=fail)
        else:
            fut = self.handle.pread(buf, extent.offset, extent.length, priority=priority,
                                    tag=key, then=done, fail=fail)
        if into is None:
            with self._lock:
                self._inflight[key] = fut
            fut.add_done_callback(lambda f, k=key: self._forget(k, f))
        return fut

    def map_file(self) -> FileMapping | None:
        """The experts file mapped whole (``mapped.FileMapping``, made once), or None where
        the kernel cannot fault a file range in (``populate_supported``). A read into a view
        of it at the expert's own offset faults the range in instead of copying it."""
        if self._mapping is None and populate_supported():
            self._mapping = FileMapping(self.path)
        return self._mapping

    def _forget(self, key: tuple[int, int], fut: ReadFuture) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    def read_expert_sync(self, layer: int, expert: int, into: Any = None, *,
                         verify: str | None = None) -> ExpertBuffer:
        return self.read_expert(layer, expert, into, verify=verify).result()

    def prefetch(self, layer: int, expert: int, into: Any = None) -> ReadFuture:
        return self.read_expert(layer, expert, into, priority=Priority.PREFETCH)

    def cancel_prefetches(self, keep: Collection[tuple[int, int]] = ()) -> int:
        """Cancel queued prefetches of experts not in ``keep``; returns how many."""
        keep = set(keep)
        return self.handle.cancel_pending(lambda f: f.tag not in keep)

    def close(self) -> None:
        self.handle.close()
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def __enter__(self) -> ExpertReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _change(was: tuple[int, int, int, int], now: tuple[int, int, int, int]) -> str | None:
    """What happened to the file between two identities, or None when nothing did."""
    if was[:2] != now[:2]:
        return (f"it was replaced by another file (inode {was[1]} is now {now[1]}); the open "
                "file is the old one")
    if now[2] < was[2]:
        return f"it was truncated from {was[2]} to {now[2]} bytes"
    if now[2] != was[2]:
        return f"it grew from {was[2]} to {now[2]} bytes"
    if now[3] != was[3]:
        return "it was rewritten in place (its modification time changed)"
    return None
