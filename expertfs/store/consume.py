"""``repack --consume-source``: the GGUF's bytes are released as the store takes them over.

Release rule. A block of a source file is punched (``fallocate(PUNCH_HOLE | KEEP_SIZE)``) only
when every byte in it is released, and a byte is released only when

1. it is a tensor byte and the one schedule ``Copy`` that reads it (each source tensor byte is
   read by exactly one) belongs to a window before a durable checkpoint: the store files were
   fdatasync'ed and the LMDB transaction with the window's records and the resume point has
   committed; and those windows passed the read-back check below; or
2. it is padding between tensors or after the last, which the pre-flight check found zero
   (unpack writes zeros there, so the file comes back bit for bit).

The header (magic, metadata, tensor table, up to the data section) is never released: it is
what a resumed run parses and fingerprints. A block that also holds header bytes or a byte of
a later window is kept. Windows are written in store order (trunk.bin, then experts layer by
layer), which is not source order, so the released bytes of a shard are kept as merged
intervals and a window releases the blocks it completes, wherever they are. Once the store is
published the source files, by then their headers and holes, are deleted (a split GGUF's
shards are emptied one window at a time, in the plan's order, and deleted together).

Read-back check. Every checksum in the index is computed while copying, from the very buffer
that is then written with one ``pwrite`` (O_DIRECT where the file system allows it: the device
is handed those bytes, not a copy), and the buffer is not refilled until that write has
returned. The writer refuses to write a window over one written before it, so a checked window
is not touched again. So once the checkpoint's fdatasync has returned and its transaction has
committed, the released bytes exist in the store, durably, and their checksums are in the index
(``verify`` and ``unpack`` check them). What remains is the storage stack losing or misplacing
a write it acknowledged; before punching, a window is checked against that from what is now
durable, without reading it all again (which would read the model twice):

- ``SEEK_HOLE``: every block of the window is allocated and written in the file system (the
  outputs are sparse in place, so a write that never landed is a hole). A file system that
  stores zero blocks as holes (ZFS with compression) makes this fail on zero runs; the
  window is then read back whole, as below.
- spot reads: its first and last 4 KiB block and one at a random place in every 2 MiB
  (``SPOT_STRIDE``) are read back, with O_DIRECT so the device answers, not the page cache
  (where O_DIRECT is refused, as on tmpfs, the page cache is the storage itself, or was dropped
  after the fdatasync), and each must equal the digest the writer took of that block in the
  buffer it wrote. Any run of two strides or more that the device lost, left stale or wrote
  elsewhere holds a whole stride, so it cannot pass; a shorter one is caught with the
  probability of a spot falling in it; bytes altered inside a write that did land are the
  device's error correction's to find, as for every other file on that disk.

Windows written by an earlier run (the spot digests died with it) and every window with
``full_readback`` are read back whole instead, and every part and trunk tensor they complete
must match its checksum in the index. Either way a mismatch releases nothing of the batch and
rewinds the resume point to what was released, so running the command again rewrites those
windows from the source.

Crash safety. The resume point records ``windows`` (written and durable) and ``released``
(windows whose bytes are released). A resumed run verifies and punches windows
``[released, windows)`` again (punching is idempotent), never reads a window before
``windows`` from the source, and reads only the headers otherwise. A marker file in the
partial store, synced before the first punch, makes every later run refuse to start over or
to delete that partial store, which from then on holds the only copy of the released bytes.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import xxhash

from ..errors import ExpertfsError, IntegrityError
from ..formats.gguf_read import GGUFModel
from ..formats.gguf_write import pad_to
from .consume_checks import (check_exact, check_sources, check_space, fs_type,  # noqa: F401
                             punch_hole)
from .index import Index
from .layout import INDEX_DIR
from .reader import Store, is_store
from .windows import Window

__all__ = ["CONSUMING", "Consumer", "Spots", "spot_digests", "checksums", "check_sources",
           "check_exact", "check_space", "fs_type", "punch_hole", "delete_sources", "head_digest",
           "already_published", "finish_in_place"]

CONSUMING = "consuming"             # the marker file in the partial store
SPOT_BLOCK = 4096                   # a spot read: one block, the smallest window alignment
SPOT_STRIDE = 2 << 20               # one spot at a random place in every 2 MiB of a window
SPOT_READERS = 64                   # spot reads in flight at once: each queues behind the
                                    # writer's large writes, so a checkpoint's ~130 spots are
                                    # latency; all in flight together, they cost about one


class _Released:
    """One shard's released bytes as merged intervals; ``add`` says which blocks to punch."""

    def __init__(self, block: int) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.block = block
        self.freed = 0

    def _interior(self, a: int, b: int) -> tuple[int, int]:
        return pad_to(a, self.block), b // self.block * self.block

    def add(self, a: int, b: int) -> tuple[int, int] | None:
        i = bisect.bisect_left(self.ends, a)
        j = bisect.bisect_right(self.starts, b)
        na, nb = (min(a, self.starts[i]), max(b, self.ends[j - 1])) if i < j else (a, b)
        for k in range(i, j):
            lo, hi = self._interior(self.starts[k], self.ends[k])
            self.freed -= max(0, hi - lo)
        self.starts[i:j], self.ends[i:j] = [na], [nb]
        lo, hi = self._interior(na, nb)
        self.freed += max(0, hi - lo)
        lo, hi = max(lo, a // self.block * self.block), min(hi, pad_to(b, self.block))
        return (lo, hi) if hi > lo else None


Spots = list[tuple[int, int]]        # (offset in the window, xxh3-64 of the block there)


class Consumer:
    """Checks windows read back from the store, then releases their source bytes."""

    def __init__(self, model: GGUFModel, partial: str, store_files: dict[str, str],
                 on_freed: Callable[[int], None] | None = None,
                 full_readback: bool = False) -> None:
        self.model, self.partial, self.files, self.on_freed = model, partial, store_files, on_freed
        self.full = full_readback
        self._rng = random.Random(os.urandom(16))    # spots nobody can predict or line up with
        self._spot: mmap.mmap | None = None
        self._pool = ThreadPoolExecutor(SPOT_READERS, thread_name_prefix="expertfs-spot")
        self.fds = [os.open(p, os.O_RDWR) for p in model.paths]
        self.sets = [_Released(max(4096, os.fstat(fd).st_blksize)) for fd in self.fds]
        for s, f in zip(self.sets, model.shards):
            for t in f.tensors:
                s.add(t.data_start + t.nbytes, t.data_start + pad_to(t.nbytes, f.alignment))
        self._buf: mmap.mmap | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        for b in (self._buf, self._spot):
            if b is not None:
                b.close()

    def digests(self, w: Window, buf: mmap.mmap) -> Spots | None:
        """The writer's ``sample``: digests of the window's spot blocks in the buffer it is about
        to write (None with ``full_readback``: those windows are read back whole)."""
        return None if self.full else spot_digests(w.length, buf, self._rng)

    @property
    def freed(self) -> int:
        return sum(s.freed for s in self.sets)

    def mark_released(self, wins: Iterable[Window]) -> None:
        """Windows a previous run released: remembered, neither read nor punched again."""
        for w in wins:
            for c in w.copies:
                self.sets[c.shard].add(c.src_off, c.src_off + c.length)

    def release(self, batch: list[tuple[Window, Spots | None]],
                sums: dict[tuple[int, ...], int] | Index) -> None:
        """Check the windows of ``batch`` (durable already; a checkpoint's, so no item continues
        past it) read back from the store: by their spots, or whole against ``sums`` (item →
        checksum, or the index to look them up in) where a window has none or has a hole; then
        punch what they complete. Safe to run in one other thread while later windows are
        written: it touches only its own state."""
        if not batch:
            return
        wins = [w for w, _ in batch]
        if self.full or any(s is None for _, s in batch) or not self._spot_check(batch):
            self._verify(sums, wins)
        self._mark_consuming()
        todo: dict[int, list[tuple[int, int]]] = {}
        for w in wins:
            for c in w.copies:
                r = self.sets[c.shard].add(c.src_off, c.src_off + c.length)
                if r is not None:
                    todo.setdefault(c.shard, []).append(r)
        for shard, ranges in todo.items():
            ranges.sort()
            merged = [list(ranges[0])]
            for a, b in ranges[1:]:
                if a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            for a, b in merged:
                punch_hole(self.fds[shard], a, b - a)
            os.fsync(self.fds[shard])       # commits the journal: the freed blocks are free now
        if self.on_freed:
            self.on_freed(self.freed)

    def _mark_consuming(self) -> None:
        path = os.path.join(self.partial, CONSUMING)
        if os.path.exists(path):
            return
        with open(path, "w") as f:
            json.dump({"sources": self.model.paths}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.partial)

    def _spot_check(self, batch: list[tuple[Window, Spots | None]]) -> bool:
        """False when a window has a hole (then it is read back whole); IntegrityError when a
        spot differs from what was written. The spots are read a few at a time: each is one
        small read queued behind the writer's large ones, so it is latency, not bandwidth."""
        fds = {name: _open_direct(p) for name, p in self.files.items()}
        try:
            todo = []
            for w, spots in batch:
                fd, direct = fds[w.file]
                if os.lseek(fd, w.dst_off, os.SEEK_HOLE) < w.dst_off + w.length:
                    return False
                todo += [(fd, direct, w.file, w.dst_off + off, want) for off, want in spots or ()]
            if not todo:
                return True
            if self._spot is None or len(self._spot) < len(todo) * SPOT_BLOCK:
                if self._spot is not None:
                    self._spot.close()
                self._spot = mmap.mmap(-1, len(todo) * SPOT_BLOCK)
            mv, views = memoryview(self._spot), []
            try:
                views = [mv[i * SPOT_BLOCK:(i + 1) * SPOT_BLOCK] for i in range(len(todo))]

                def read(i: int) -> None:
                    fd, direct, name, off, _ = todo[i]
                    self._read(fd, views[i], off, self.files[name])
                    if not direct:
                        os.posix_fadvise(fd, off, SPOT_BLOCK, os.POSIX_FADV_DONTNEED)
                list(self._pool.map(read, range(len(todo))))
                for v, (_, _, name, off, want) in zip(views, todo):
                    if xxhash.xxh3_64_intdigest(v) != want:
                        raise IntegrityError(
                            f"read back from the store, the 4 KiB at byte {off} differ from "
                            "what was written there; the source bytes of that checkpoint were "
                            "not released", path=self.files[name], fix="check the disk "
                            "(dmesg), then run the same command again: it rewrites them from "
                            "the source")
            finally:
                for v in views:
                    v.release()
                mv.release()
        finally:
            for fd, _ in fds.values():
                os.close(fd)
        return True

    def _verify(self, sums: dict[tuple[int, ...], int] | Index, wins: list[Window]) -> None:
        size = max(w.length for w in wins)
        if self._buf is None or len(self._buf) < size:
            if self._buf is not None:
                self._buf.close()
            self._buf = mmap.mmap(-1, max(size, mmap.PAGESIZE))
        fds = {name: os.open(p, os.O_RDONLY) for name, p in self.files.items()}
        hashers: dict[tuple[int, ...], xxhash.xxh3_64] = {}
        mv = memoryview(self._buf)
        try:
            for w in wins:
                self._read(fds[w.file], mv[:w.length], w.dst_off, self.files[w.file])
                os.posix_fadvise(fds[w.file], w.dst_off, w.length, os.POSIX_FADV_DONTNEED)
                for h in w.hashes:
                    x = hashers.setdefault(h.item, xxhash.xxh3_64())
                    x.update(mv[h.buf_off:h.buf_off + h.length])
                    if h.last and hashers.pop(h.item).intdigest() != _expected(sums, h.item):
                        raise IntegrityError(
                            f"read back from the store, {_name(self.model, h.item)} differs from "
                            "what was written; its source bytes were not released",
                            path=self.files[w.file], fix="check the disk (dmesg), then run the "
                            "same command again: it rewrites them from the source")
        finally:
            mv.release()
            for fd in fds.values():
                os.close(fd)

    @staticmethod
    def _read(fd: int, dst: memoryview, off: int, path: str) -> None:
        pos = 0
        while pos < len(dst):
            n = os.preadv(fd, [dst[pos:]], off + pos)
            if n <= 0:
                raise ExpertfsError(f"ends at byte {off + pos} while reading back what was just "
                                    "written", path=path, fix="check the disk and run again")
            pos += n


def spot_digests(length: int, buf: mmap.mmap | bytes, rng: random.Random) -> Spots:
    """The spots of a window of ``length`` bytes (a multiple of ``SPOT_BLOCK``): its first and
    last block and one at a random place in every ``SPOT_STRIDE``, with their digests in ``buf``."""
    n, per = length // SPOT_BLOCK, SPOT_STRIDE // SPOT_BLOCK
    picks = {0, n - 1} | {c + rng.randrange(min(per, n - c)) for c in range(0, n, per)}
    return [(b * SPOT_BLOCK, xxhash.xxh3_64_intdigest(buf[b * SPOT_BLOCK:(b + 1) * SPOT_BLOCK]))
            for b in sorted(picks)]


def _open_direct(path: str) -> tuple[int, bool]:
    """A read-only fd on ``path``, O_DIRECT where the file system allows it."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        return os.open(path, os.O_RDONLY), False


def head_digest(path: str, n: int) -> str:
    """xxh3-64 (hex) of a file's first ``n`` bytes: its GGUF header, which is never released."""
    with open(path, "rb") as f:
        return xxhash.xxh3_64_hexdigest(f.read(n))


def delete_sources(paths: list[str]) -> None:
    """Unlink the emptied source files (once the store is published) and sync their folders."""
    folders = set()
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        folders.add(os.path.dirname(os.path.abspath(p)))
    for d in folders:
        _fsync_dir(d)


def checksums(extents: Iterable, trunk: Iterable) -> dict[tuple[int, ...], int]:
    """Item → checksum of finished extent and trunk records, the keys of ``HashOp.item``."""
    out = {(t.index,): t.checksum for t in trunk}
    for e in extents:
        out.update({(e.layer, e.expert, i): p.checksum for i, p in enumerate(e.parts)})
    return out


def _expected(idx: dict[tuple[int, ...], int] | Index, item: tuple[int, ...]) -> int | None:
    if isinstance(idx, dict):
        return idx.get(item)
    if len(item) == 3:
        ext = idx.extent(item[0], item[1])
        return None if ext is None else ext.parts[item[2]].checksum
    rec = idx.tensor(item[0])
    return None if rec is None else rec.checksum


def _name(model: GGUFModel, item: tuple[int, ...]) -> str:
    if len(item) == 3:
        return f"layer {item[0]} expert {item[1]} part {item[2]}"
    return f"trunk tensor {model.tensors[item[0]].name!r}"


def already_published(out: str, sources: list[str]) -> dict | None:
    """The summary of a store an in-place repack published before it was killed, after deleting
    what is left of its sources (each checked against the size and header the store recorded);
    None when ``out`` is not such a store of these sources."""
    if not (os.path.isdir(out) and is_store(out)):
        return None
    try:
        with Store.open(out) as st:
            summary = dict(st.summary)
    except ExpertfsError:
        return None
    heads = (summary.get("in_place") or {}).get("headers") or []
    paths = [os.path.abspath(os.fspath(p)) for p in sources]
    if not paths or not {os.path.basename(p) for p in paths} <= {h[0] for h in heads}:
        return None
    left = []
    for name, size, head_len, digest in heads:
        p = os.path.join(os.path.dirname(paths[0]), name)
        if os.path.exists(p):
            if os.path.getsize(p) != size or head_digest(p, head_len) != digest:
                return None                  # another file by that name: not this store's source
            left.append(p)
    finish_in_place(out, left)
    return summary


def finish_in_place(out: str, sources: list[str]) -> None:
    """After publishing in place: drop the resume point and the marker, delete the sources."""
    with Index.open(os.path.join(out, INDEX_DIR), write=True) as idx:
        if idx.meta("progress") is not None:
            idx.commit(delete_meta=["progress"])
    marker = os.path.join(out, CONSUMING)
    if os.path.exists(marker):
        os.unlink(marker)
        _fsync_dir(out)
    delete_sources(sources)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
