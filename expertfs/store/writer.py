"""Executes a repack schedule: reads source ranges, writes aligned windows, checksums parts.

Reading and writing overlap: reader threads fill the next windows' buffers (``preadv`` straight
into each part's place, no extra copy) while this thread hashes and writes the current one.
Memory is ``depth`` page-aligned buffers of one window each, whatever the model's size.
Outputs are written with O_DIRECT where the file system allows it (the page cache is left
alone); elsewhere buffered, synced and dropped at each checkpoint. Source pages are dropped
once read (``POSIX_FADV_DONTNEED``) so a repack on a low-RAM box does not evict the user's
working set.

Each file's windows are written in increasing, non-overlapping order (checked before every
write), so a window once written is never touched again by this run: what ``--consume-source``
verified of it stays true until the store is published.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import xxhash

from ..errors import DiskFullError, ExpertfsError, FormatError, IntegrityError
from ..formats.moe_names import layer_of
from .layout import Extent, Part, TensorRecord, KIND_TRUNK
from .plan import RepackPlan
from .windows import Copy, Window

__all__ = ["WindowWriter", "Completed", "open_output", "is_disk_full", "write_error"]

log = logging.getLogger(__name__)
_IOV_MAX = 1024
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in _DISK_FULL


def open_output(path: str, size: int, direct: bool = True,
                prealloc: bool = True) -> tuple[int, bool]:
    """Open (creating) an output file of ``size`` bytes, preallocated unless ``prealloc`` is
    false (then sparse: blocks are allocated as they are written); returns (fd, is_direct)."""
    flags = os.O_WRONLY | os.O_CREAT
    fd = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("%s: O_DIRECT not supported here; writing through the page cache", path)
    is_direct = fd >= 0
    if fd < 0:
        fd = os.open(path, flags, 0o644)
    if size and prealloc:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL) or is_disk_full(e):
                os.close(fd)
                raise
    os.ftruncate(fd, size)
    return fd, is_direct


@dataclass
class Completed:
    """Records finished by one window, to be committed at the next checkpoint."""

    extents: list[Extent]
    trunk: list[TensorRecord]
    spots: Any = None           # what ``sample`` took of the window's buffer before the write


class WindowWriter:
    """Fills and writes windows in order; ``run`` calls ``on_window`` after each one.

    ``sample(window, buffer)``, if given, is called with each window's filled buffer after it is
    hashed and before it is written; its result is ``Completed.spots``."""

    def __init__(self, plan: RepackPlan, out_fds: dict[str, tuple[int, bool]], capacity: int,
                 depth: int = 3, readers: int = 2,
                 sample: Callable[[Window, mmap.mmap], Any] | None = None) -> None:
        self.plan = plan
        self.out = out_fds
        self.sample = sample
        self._ends: dict[str, int] = {}
        self.src = [os.open(p, os.O_RDONLY) for p in plan.model.paths]
        self.bufs = [mmap.mmap(-1, max(capacity, mmap.PAGESIZE)) for _ in range(depth)]
        self.pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="expertfs-read")
        self._hashers: dict[tuple[int, ...], xxhash.xxh3_64] = {}
        self._done_hash: dict[tuple[int, ...], int] = {}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for fd in self.src:
            os.close(fd)
        for b in self.bufs:
            b.close()

    # --- reading ----------------------------------------------------------------------------

    def _fill(self, w: Window, buf: mmap.mmap) -> None:
        mv = memoryview(buf)
        try:
            covered = sorted((c.buf_off, c.buf_off + c.length) for c in w.copies)
            pos = 0
            for a, b in covered + [(w.length, w.length)]:
                if a > pos:
                    mv[pos:a] = bytes(a - pos)
                pos = max(pos, b)
            for shard, run in _runs(w.copies):
                self._preadv(shard, run, mv)
        finally:
            mv.release()

    def _preadv(self, shard: int, run: list[Copy], mv: memoryview) -> None:
        fd = self.src[shard]
        start = run[0].src_off
        total = sum(c.length for c in run)
        for i in range(0, len(run), _IOV_MAX):
            chunk = run[i:i + _IOV_MAX]
            iov = [mv[c.buf_off:c.buf_off + c.length] for c in chunk]
            off = chunk[0].src_off
            want = sum(c.length for c in chunk)
            if os.preadv(fd, iov, off) < want:   # short: the file shrank, or a signal
                for c in chunk:
                    self._pread_full(shard, mv[c.buf_off:c.buf_off + c.length], c.src_off)
        os.posix_fadvise(fd, start, total, os.POSIX_FADV_DONTNEED)

    def _pread_full(self, shard: int, dst: memoryview, off: int) -> None:
        pos = 0
        while pos < len(dst):
            n = os.preadv(self.src[shard], [dst[pos:]], off + pos)
            if n == 0:
                raise FormatError(f"unexpected end of file at byte {off + pos}: the file shrank "
                                  "while it was being read", path=self.plan.model.paths[shard],
                                  fix="do not modify the model during repack; run it again")
            pos += n

    # --- writing ----------------------------------------------------------------------------

    def _write(self, w: Window, buf: mmap.mmap) -> None:
        if w.dst_off < self._ends.get(w.file, 0):
            raise IntegrityError(f"window at byte {w.dst_off} overlaps one written before it "
                                 "(a bug in the copy schedule); nothing was written there",
                                 path=w.file, fix="report this; repack without "
                                 "--consume-source meanwhile")
        self._ends[w.file] = w.dst_off + w.length
        fd, _ = self.out[w.file]
        mv = memoryview(buf)
        try:
            pos = 0
            while pos < w.length:
                n = os.pwrite(fd, mv[pos:w.length], w.dst_off + pos)
                if n <= 0:
                    raise OSError(errno.EIO, "pwrite wrote nothing")
                pos += n
        finally:
            mv.release()

    def _hash(self, w: Window, buf: mmap.mmap) -> Completed:
        mv = memoryview(buf)
        try:
            for h in w.hashes:
                x = self._hashers.get(h.item)
                if x is None:
                    x = self._hashers[h.item] = xxhash.xxh3_64()
                x.update(mv[h.buf_off:h.buf_off + h.length])
                if h.last:
                    self._done_hash[h.item] = self._hashers.pop(h.item).intdigest()
        finally:
            mv.release()
        return self._records(w)

    def _records(self, w: Window) -> Completed:
        extents = []
        for lp, e in w.extents:
            parts = tuple(Part(p.role, self.plan.model.tensors[p.tensor_index].ggml_type,
                               p.tensor_index, p.ne, p.rel_offset, p.nbytes,
                               self._done_hash.pop((lp.layer, e, i)))
                          for i, p in enumerate(lp.parts))
            extents.append(Extent(lp.layer, e, lp.extent_offset(e), lp.extent_len, parts))
        trunk = []
        for tp in w.trunk:
            t = self.plan.model.tensors[tp.tensor_index]
            trunk.append(TensorRecord(tp.tensor_index, t.name, KIND_TRUNK, t.ggml_type, t.ne,
                                      _layer(t.name), tp.offset, tp.nbytes,
                                      self._done_hash.pop((tp.tensor_index,))))
        return Completed(extents, trunk)

    def run(self, todo: Iterable[Window], on_window: Callable[[Window, Completed], None]) -> None:
        """Fill, hash and write every window of ``todo`` in order."""
        it = iter(todo)
        pending: deque[tuple[Window, mmap.mmap, Future[None]]] = deque()
        free = list(self.bufs)

        def submit() -> bool:
            w = next(it, None)
            if w is None:
                return False
            buf = free.pop()
            pending.append((w, buf, self.pool.submit(self._fill, w, buf)))
            return True

        while free and submit():
            pass
        while pending:
            w, buf, fut = pending.popleft()
            fut.result()
            done = self._hash(w, buf)
            if self.sample is not None:
                done.spots = self.sample(w, buf)
            self._write(w, buf)
            free.append(buf)
            submit()
            on_window(w, done)


def _runs(copies: list[Copy]) -> list[tuple[int, list[Copy]]]:
    """Copies grouped per shard into runs of adjacent source bytes (one preadv each)."""
    out: list[tuple[int, list[Copy]]] = []
    for c in sorted(copies, key=lambda c: (c.shard, c.src_off)):
        if out and out[-1][0] == c.shard:
            last = out[-1][1][-1]
            if last.src_off + last.length == c.src_off:
                out[-1][1].append(c)
                continue
        out.append((c.shard, [c]))
    return out


def _layer(name: str) -> int:
    n = layer_of(name)
    return -1 if n is None else n


def write_error(path: str, e: OSError) -> ExpertfsError:
    """Translate an OSError while writing into a typed error."""
    if is_disk_full(e):
        return DiskFullError(f"the file system is full ({e.strerror})", path=path,
                             fix="free space or choose another -o; temporary files were removed")
    return ExpertfsError(f"write failed: {e.strerror}", path=path, fix="check the disk and retry")
