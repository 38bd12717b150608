"""``repack --consume-source``: the GGUF's bytes are released as the store takes them over.

Release rule. A block of a source file is punched (``fallocate(PUNCH_HOLE | KEEP_SIZE)``) only
when every byte in it is released, and a byte is released only when

1. it is a tensor byte and the one schedule ``Copy`` that reads it (each source tensor byte is
   read by exactly one) belongs to a window before a durable checkpoint: the store files were
   fdatasync'ed and the LMDB transaction with the window's records and the resume point has
   committed; and those windows were read back from the store and every part and trunk tensor
   they complete matched its checksum in the index; or
2. it is padding between tensors or after the last, which the pre-flight check found zero
   (unpack writes zeros there, so the file comes back bit for bit).

The header (magic, metadata, tensor table, up to the data section) is never released: it is
what a resumed run parses and fingerprints. A block that also holds header bytes or a byte of
a later window is kept. Windows are written in store order (trunk.bin, then experts layer by
layer), which is not source order, so the released bytes of a shard are kept as merged
intervals and a window releases the blocks it completes, wherever they are. Once the store is
published the source files, by then their headers and holes, are deleted (a split GGUF's
shards are emptied one window at a time, in the plan's order, and deleted together).

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

__all__ = ["CONSUMING", "Consumer", "checksums", "check_sources", "check_exact", "check_space",
           "fs_type", "punch_hole", "delete_sources", "head_digest", "already_published",
           "finish_in_place"]

CONSUMING = "consuming"             # the marker file in the partial store


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


class Consumer:
    """Verifies windows read back from the store, then releases their source bytes."""

    def __init__(self, model: GGUFModel, partial: str, store_files: dict[str, str],
                 on_freed: Callable[[int], None] | None = None) -> None:
        self.model, self.partial, self.files, self.on_freed = model, partial, store_files, on_freed
        self.fds = [os.open(p, os.O_RDWR) for p in model.paths]
        self.sets = [_Released(max(4096, os.fstat(fd).st_blksize)) for fd in self.fds]
        for s, f in zip(self.sets, model.shards):
            for t in f.tensors:
                s.add(t.data_start + t.nbytes, t.data_start + pad_to(t.nbytes, f.alignment))
        self._buf: mmap.mmap | None = None

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        if self._buf is not None:
            self._buf.close()

    @property
    def freed(self) -> int:
        return sum(s.freed for s in self.sets)

    def mark_released(self, wins: Iterable[Window]) -> None:
        """Windows a previous run released: remembered, neither read nor punched again."""
        for w in wins:
            for c in w.copies:
                self.sets[c.shard].add(c.src_off, c.src_off + c.length)

    def release(self, wins: list[Window], sums: dict[tuple[int, ...], int] | Index) -> None:
        """Verify ``wins`` (durable already) read back from the store against ``sums`` (item →
        checksum, or the index to look them up in), then punch what they complete. Safe to run
        in one other thread while later windows are written: it touches only its own state."""
        if not wins:
            return
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
